"""Start the tracer in this process: PyTorch's global optimizer hooks and thin wrappers around
Module.__call__, Tensor.backward, torch.save / torch.load, safetensors and os.replace / os.rename.
Every wrapper calls the original unchanged and only records what went through it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .hooks import Tracer, file_path


def start_from_environment() -> Tracer | None:
    folder = os.environ.get("EXACTRESUME_DOCTOR_TRACE")
    if not folder:
        return None
    crash_from = os.environ.get("EXACTRESUME_DOCTOR_CRASH_FROM")
    tracer = Tracer(
        folder, int(os.environ.get("EXACTRESUME_DOCTOR_LIMIT", "1000000000")), int(crash_from) if crash_from else None
    )
    install(tracer)
    return tracer


def install(tracer: Tracer) -> None:
    tracer.live.install()
    register_optimizer_step_pre_hook(tracer.before_step)
    register_optimizer_step_post_hook(tracer.after_step)
    wrap_module_call(tracer)
    wrap_backward(tracer)
    wrap_files(tracer)
    atexit.register(lambda: tracer.close({"event": "exit", "steps": tracer.step}))


def wrap_module_call(tracer: Tracer) -> None:
    original = torch.nn.Module.__call__

    def call(module, *args, **kwargs):
        if tracer.depth == 0:
            tracer.on_forward(module, args, kwargs)
        tracer.depth += 1
        try:
            return original(module, *args, **kwargs)
        finally:
            tracer.depth -= 1

    torch.nn.Module.__call__ = call


def wrap_backward(tracer: Tracer) -> None:
    original = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        tracer.on_backward(tensor)
        return original(tensor, *args, **kwargs)

    torch.Tensor.backward = backward


def wrap_files(tracer: Tracer) -> None:
    save, load, replace, rename = torch.save, torch.load, os.replace, os.rename

    def traced_save(obj, f, *args, **kwargs):
        result = save(obj, f, *args, **kwargs)
        tracer.on_save(obj, file_path(f))
        return result

    def traced_load(f, *args, **kwargs):
        tracer.on_load(file_path(f))
        return load(f, *args, **kwargs)

    def traced_replace(source, target, *args, **kwargs):
        replace(source, target, *args, **kwargs)
        tracer.on_rename(source, target)

    def traced_rename(source, target, *args, **kwargs):
        rename(source, target, *args, **kwargs)
        tracer.on_rename(source, target)

    torch.save = torch.serialization.save = traced_save
    torch.load = torch.serialization.load = traced_load
    os.replace, os.rename = traced_replace, traced_rename
    if importlib.util.find_spec("safetensors") is not None:
        wrap_safetensors(tracer)


def wrap_safetensors(tracer: Tracer) -> None:
    import safetensors.torch as st

    save_file, load_file = st.save_file, st.load_file

    def traced_save_file(tensors, filename, *args, **kwargs):
        result = save_file(tensors, filename, *args, **kwargs)
        tracer.on_save(tensors, file_path(filename))
        return result

    def traced_load_file(filename, *args, **kwargs):
        tracer.on_load(file_path(filename))
        return load_file(filename, *args, **kwargs)

    st.save_file, st.load_file = traced_save_file, traced_load_file
