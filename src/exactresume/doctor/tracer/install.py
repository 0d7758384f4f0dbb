"""Start the tracer in this process: PyTorch's global optimizer hooks and thin wrappers around
Module.__call__, Tensor.backward, DataLoader iterators, torch.set_rng_state, torch.save / torch.load,
safetensors, DCP, os.replace / os.rename and every writer of files (files.py).
Every wrapper calls the original unchanged and only records what went through it; `install`
returns the function that takes them all off again (the overhead bench uses it).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import fingerprint as fp
from .files import wrap_writes
from .hooks import Tracer, file_path


def start_from_environment() -> Tracer | None:
    folder = os.environ.get("EXACTRESUME_DOCTOR_TRACE")
    if not folder:
        return None
    crash_from = os.environ.get("EXACTRESUME_DOCTOR_CRASH_FROM")
    limit = int(os.environ.get("EXACTRESUME_DOCTOR_LIMIT", "1000000000"))
    keep, ignore = os.environ.get("EXACTRESUME_DOCTOR_KEEP"), os.environ.get("EXACTRESUME_DOCTOR_OUT")
    made = os.environ.get("EXACTRESUME_DOCTOR_MADE", "")
    tracer = Tracer(folder, limit, int(crash_from) if crash_from else None, keep, ignore)
    tracer.files.made = tuple(os.path.join(path, "") for path in made.split(os.pathsep) if path)
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
    wrap_data(tracer, patches)
    wrap_files(tracer, patches)
    wrap_writes(tracer.files, patches.replace)
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


def rng_state() -> str:
    return fp.digest(torch.get_rng_state())


def wrap_data(tracer: Tracer, patches: Patches) -> None:
    """DataLoader iterators (each epoch's, and each batch they yield) and torch.set_rng_state."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    def iterating(original):
        def traced(loader):
            before = rng_state()
            iterator = original(loader)
            tracer.on_iterator(loader, iterator, rng_state() != before)
            return iterator

        return traced

    def fetching(original):
        def traced(iterator):
            before = rng_state()
            batch = original(iterator)
            tracer.on_fetch(iterator, rng_state() != before)
            return batch

        return traced

    def setting(original):
        def traced(*args, **kwargs):
            original(*args, **kwargs)
            tracer.on_rng_set()

        return traced

    patches.replace(torch.utils.data.DataLoader, "__iter__", iterating)
    patches.replace(_BaseDataLoaderIter, "__next__", fetching)
    for owner in (torch, torch.random):
        patches.replace(owner, "set_rng_state", setting)


def saving(tracer: Tracer, original):
    def traced(obj, f, *args, **kwargs):
        if tracer.inside:  # a save within a traced one (DCP writes some items with torch.save)
            return original(obj, f, *args, **kwargs)
        if isinstance(f, str | os.PathLike):
            tracer.files.before_write(f)
        with tracer.within():
            result = original(obj, f, *args, **kwargs)
        tracer.on_save(obj, file_path(f))
        return result

    return traced


def loading(tracer: Tracer, original):
    def traced(f, *args, **kwargs):
        if not tracer.inside:
            tracer.on_load(file_path(f))
        with tracer.within():
            return original(f, *args, **kwargs)

    return traced


def renaming(tracer: Tracer, original):
    def traced(source, target, *args, **kwargs):
        tracer.files.before_write(target)
        original(source, target, *args, **kwargs)
        tracer.on_rename(source, target)

    return traced


def wrap_files(tracer: Tracer, patches: Patches) -> None:
    for owner in (torch, torch.serialization):
        patches.replace(owner, "save", lambda original: saving(tracer, original))
        patches.replace(owner, "load", lambda original: loading(tracer, original))
    for name in ("replace", "rename"):
        patches.replace(os, name, lambda original: renaming(tracer, original))
    patches.replace(shutil, "move", lambda original: renaming(tracer, original))  # across devices it copies
    if "torch.distributed.checkpoint" in sys.modules:
        wrap_dcp(tracer, patches, sys.modules["torch.distributed.checkpoint"])
    else:  # DCP takes half a second to import: wrap it only when the script imports it
        finder = AfterImport("torch.distributed.checkpoint", lambda module: wrap_dcp(tracer, patches, module))
        sys.meta_path.insert(0, finder)
        patches.undo.append(lambda: finder in sys.meta_path and sys.meta_path.remove(finder))
    if importlib.util.find_spec("safetensors") is not None:
        import safetensors.torch as st

        patches.replace(st, "save_file", lambda original: saving(tracer, original))
        patches.replace(st, "load_file", lambda original: loading(tracer, original))


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after the module `name` is first imported, then steps aside."""

    def __init__(self, name: str, then: Callable):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module):
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def dcp_path(kwargs: dict, role: str) -> str | None:
    """The folder a torch.distributed.checkpoint save or load names (checkpoint_id, or its storage's path)."""
    where = kwargs.get("checkpoint_id") or getattr(kwargs.get(role), "path", None)
    return os.path.abspath(where) if isinstance(where, str | os.PathLike) else None


def wrap_dcp(tracer: Tracer, patches: Patches, module) -> None:
    def saving_dcp(original):
        def traced(state_dict, *args, **kwargs):
            tracer.files.before_write(dcp_path(kwargs, "storage_writer"))
            with tracer.within():
                result = original(state_dict, *args, **kwargs)
            tracer.on_save(state_dict, dcp_path(kwargs, "storage_writer"))
            return result

        return traced

    def loading_dcp(original):
        def traced(state_dict, *args, **kwargs):
            tracer.on_load(dcp_path(kwargs, "storage_reader"))
            with tracer.within():
                return original(state_dict, *args, **kwargs)

        return traced

    patches.replace(module, "save", saving_dcp)
    patches.replace(module, "load", loading_dcp)
