"""Start the tracer in this process: PyTorch's global optimizer hooks and thin wrappers around
Module.__call__, Tensor.backward, torch.save / torch.load, safetensors and os.replace / os.rename.
Every wrapper calls the original unchanged and only records what went through it; `install`
returns the function that takes them all off again (the overhead bench uses it).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .hooks import Tracer, file_path


def start_from_environment() -> Tracer | None:
    folder = os.environ.get("EXACTRESUME_DOCTOR_TRACE")
    if not folder:
        return None
    crash_from = os.environ.get("EXACTRESUME_DOCTOR_CRASH_FROM")
    limit = int(os.environ.get("EXACTRESUME_DOCTOR_LIMIT", "1000000000"))
    keep = os.environ.get("EXACTRESUME_DOCTOR_KEEP")
    tracer = Tracer(folder, limit, int(crash_from) if crash_from else None, keep)
    install(tracer)
    atexit.register(lambda: tracer.close({"event": "exit", "steps": tracer.step}))
    return tracer


class Patches:
    """Attributes replaced on modules and classes, and how to put the originals back."""

    def __init__(self):
        self.undo: list[Callable[[], None]] = []

    def replace(self, owner, name: str, make: Callable) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self.undo.append(lambda: setattr(owner, name, original))

    def remove(self) -> None:
        while self.undo:
            self.undo.pop()()


def install(tracer: Tracer) -> Callable[[], None]:
    patches = Patches()
    tracer.live.install(patches.replace)
    for handle in (
        register_optimizer_step_pre_hook(tracer.before_step),
        register_optimizer_step_post_hook(tracer.after_step),
    ):
        patches.undo.append(handle.remove)
    patches.replace(torch.nn.Module, "__call__", lambda original: module_call(tracer, original))
    patches.replace(torch.Tensor, "backward", lambda original: backward(tracer, original))
    wrap_files(tracer, patches)
    return patches.remove


def module_call(tracer: Tracer, original):
    def call(module, *args, **kwargs):
        if tracer.depth == 0:
            tracer.on_forward(module, args, kwargs)
        tracer.depth += 1
        try:
            return original(module, *args, **kwargs)
        finally:
            tracer.depth -= 1

    return call


def backward(tracer: Tracer, original):
    def traced(tensor, *args, **kwargs):
        tracer.on_backward(tensor)
        return original(tensor, *args, **kwargs)

    return traced


def saving(tracer: Tracer, original):
    def traced(obj, f, *args, **kwargs):
        if isinstance(f, str | os.PathLike):
            tracer.before_write(file_path(f))
        result = original(obj, f, *args, **kwargs)
        tracer.on_save(obj, file_path(f))
        return result

    return traced


def loading(tracer: Tracer, original):
    def traced(f, *args, **kwargs):
        tracer.on_load(file_path(f))
        return original(f, *args, **kwargs)

    return traced


def renaming(tracer: Tracer, original):
    def traced(source, target, *args, **kwargs):
        tracer.before_write(os.path.abspath(target))
        original(source, target, *args, **kwargs)
        tracer.on_rename(source, target)

    return traced


def wrap_files(tracer: Tracer, patches: Patches) -> None:
    for owner in (torch, torch.serialization):
        patches.replace(owner, "save", lambda original: saving(tracer, original))
        patches.replace(owner, "load", lambda original: loading(tracer, original))
    for name in ("replace", "rename"):
        patches.replace(os, name, lambda original: renaming(tracer, original))
    if importlib.util.find_spec("safetensors") is not None:
        import safetensors.torch as st

        patches.replace(st, "save_file", lambda original: saving(tracer, original))
        patches.replace(st, "load_file", lambda original: loading(tracer, original))
