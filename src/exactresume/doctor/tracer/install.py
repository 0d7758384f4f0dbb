"""Start the tracer in this process: PyTorch's global optimizer hooks and thin wrappers around
Module.__call__, Tensor.backward, DataLoader iterators, torch.set_rng_state, torch.save / torch.load,
safetensors, DCP, os.replace / os.rename and every writer of files (files.py).
Every wrapper calls the original unchanged, once, and only records what went through it; what it
records goes through the tracer's guard (guard.py), so that a failure of the tracer's own is never
the script's. `install` returns the function that takes them all off again (the overhead bench uses it).
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Collection

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import dcp
from . import fingerprint as fp
from .files import wrap_writes
from .hooks import Tracer, file_path
from .sources import wrap_constructors


def start_from_environment(preloaded: Collection[str] = ()) -> Tracer | None:
    """The tracer, where the doctor's variables ask for one. `preloaded`: the modules a fork server imported
    for the user (`doctor --preload`) before this run began, whose names bound to a function the tracer
    wraps (`from safetensors.torch import save_file`) are bound to its wrapper, as they would be had they
    been imported after the tracer started."""
    folder = os.environ.get("EXACTRESUME_DOCTOR_TRACE")
    if not folder:
        return None
    crash_from = os.environ.get("EXACTRESUME_DOCTOR_CRASH_FROM")
    limit = int(os.environ.get("EXACTRESUME_DOCTOR_LIMIT", "1000000000"))
    keep, ignore = os.environ.get("EXACTRESUME_DOCTOR_KEEP"), os.environ.get("EXACTRESUME_DOCTOR_OUT")
    made = os.environ.get("EXACTRESUME_DOCTOR_MADE", "")
    tracer = Tracer(folder, limit, int(crash_from) if crash_from else None, keep, ignore)
    fail_from = os.environ.get("EXACTRESUME_DOCTOR_FAIL_FROM")  # the doctor's own tests only
    tracer.fail_from = int(fail_from) if fail_from else None
    doctor = os.environ.get("EXACTRESUME_DOCTOR_PID")
    tracer.doctor_pid = int(doctor) if doctor else None
    tracer.files.made = tuple(os.path.join(path, "") for path in made.split(os.pathsep) if path)
    install(tracer, [sys.modules[name] for name in preloaded if name in sys.modules])
    atexit.register(lambda: tracer.close({"event": "exit", "steps": tracer.step}))
    return tracer


class Patches:
    """Attributes replaced on modules and classes, and how to put the originals back."""

    def __init__(self):
        self.undo: list[Callable[[], None]] = []
        self.wrappers: dict[int, tuple[object, object]] = {}  # id(original) -> (original, its wrapper)

    def replace(self, owner, name: str, make: Callable) -> None:
        original = getattr(owner, name)
        wrapper = make(original)
        setattr(owner, name, wrapper)
        self.wrappers[id(original)] = (original, wrapper)
        self.undo.append(lambda: setattr(owner, name, original))

    def rebind(self, modules: list) -> None:
        """Every name of `modules` bound to a replaced original, bound to its wrapper instead."""
        for module in modules:
            for name, value in list(vars(module).items()):
                original, wrapper = self.wrappers.get(id(value), (None, None))
                if original is value:
                    setattr(module, name, wrapper)
                    self.undo.append(lambda module=module, name=name, value=value: setattr(module, name, value))

    def remove(self) -> None:
        while self.undo:
            self.undo.pop()()


class Guarded:
    """`target` seen through the tracer's guard: each of its methods called through this reports its own
    failure as lost sight of `what` (files.py's wrappers call the tracer's Files this way)."""

    def __init__(self, tracer: Tracer, target, what: str):
        object.__setattr__(self, "_guarded", (tracer, target, what))

    def __getattr__(self, name: str):
        tracer, target, what = self._guarded
        value = getattr(target, name)
        if not callable(value):
            return value
        return lambda *args, **kwargs: tracer.attempt(what, value, *args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._guarded[1], name, value)


def install(tracer: Tracer, preloaded: list | None = None) -> Callable[[], None]:
    """Every hook and wrapper in place (and in the `preloaded` modules' names: Patches.rebind); what
    takes them off."""
    patches = Patches()
    tracer.live.install(patches.replace, tracer.attempt)
    for handle in (
        register_optimizer_step_pre_hook(lambda *args: tracer.attempt("the steps", tracer.before_step, *args)),
        register_optimizer_step_post_hook(lambda *args: tracer.attempt("the steps", tracer.after_step, *args)),
    ):
        patches.undo.append(handle.remove)
    patches.replace(torch.nn.Module, "__call__", lambda original: _module_call(tracer, original))
    patches.replace(torch.Tensor, "backward", lambda original: backward(tracer, original))
    _wrap_data(tracer, patches)
    wrap_constructors(
        tracer.sources, patches.replace, tracer.attempt, lambda name, wrap: after_import(tracer, patches, name, wrap)
    )
    _wrap_files(tracer, patches)
    wrap_writes(Guarded(tracer, tracer.files, "the files it writes"), patches.replace)
    patches.rebind(preloaded or [])
    return patches.remove


def _module_call(tracer: Tracer, original):
    def call(module, *args, **kwargs):
        outer = tracer.depth == 0
        if outer:
            tracer.attempt("the batch", tracer.on_forward, module, args, kwargs)
        tracer.depth += 1
        try:
            result = original(module, *args, **kwargs)
        finally:
            tracer.depth -= 1
        if outer and torch.is_grad_enabled():  # the RNG as a dropout left it: a script may keep that state
            tracer.attempt("the RNG states", tracer.live.saw_rng)
        return result

    return call


def backward(tracer: Tracer, original):
    def traced(tensor, *args, **kwargs):
        tracer.attempt("the loss", tracer.on_backward, tensor)
        return original(tensor, *args, **kwargs)

    return traced


def rng_state() -> str:
    return fp.digest(torch.get_rng_state())


def drew(tracer: Tracer, before: str | None, where: str) -> bool:
    """Whether the global torch RNG moved since `before` (None: it could not be read then)."""
    found = before is not None and rng_state() != before
    if found:
        tracer.on_draw(where)
    return found


def iterating(tracer: Tracer, original):
    """A loader's __iter__: each iterator it makes (an epoch begins), and whether that drew from the torch RNG."""

    def traced(loader):
        before = tracer.attempt("what drew from the torch RNG", rng_state)
        began = tracer.attempt("the DataLoaders", tracer.live.states, loader)
        tracer.attempt("the DataLoaders", tracer.live.note_seeds, loader)
        iterator = original(loader)
        moved = tracer.attempt("what drew from the torch RNG", drew, tracer, before, "iterator", default=False)
        tracer.attempt("the DataLoaders", tracer.on_iterator, loader, iterator, moved, began)
        return iterator

    return traced


def _wrap_data(tracer: Tracer, patches: Patches) -> None:
    """DataLoader iterators (each epoch's, and each batch they yield) and torch.set_rng_state."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    def fetching(original):
        def traced(iterator):
            before = tracer.attempt("what drew from the torch RNG", rng_state)
            batch = original(iterator)
            tracer.attempt("what drew from the torch RNG", drew, tracer, before, "fetch")
            tracer.attempt("the DataLoaders", tracer.on_fetch, iterator)
            return batch

        return traced

    def next_index(original):
        def traced(iterator):
            index = original(iterator)
            tracer.attempt("the samples read", tracer.on_index, iterator, index)
            return index

        return traced

    def setting(original):
        def traced(*args, **kwargs):
            result = original(*args, **kwargs)
            tracer.attempt("the torch RNG states set", tracer.on_rng_set)
            return result

        return traced

    patches.replace(torch.utils.data.DataLoader, "__iter__", lambda original: iterating(tracer, original))
    patches.replace(_BaseDataLoaderIter, "__next__", fetching)
    patches.replace(_BaseDataLoaderIter, "_next_index", next_index)
    for owner in (torch, torch.random):
        patches.replace(owner, "set_rng_state", setting)
    # torchdata's StatefulDataLoader makes itself and its iterators without DataLoader's __init__ and __iter__
    module = "torchdata.stateful_dataloader.stateful_dataloader"
    after_import(tracer, patches, module, lambda found: _wrap_stateful(tracer, patches, found.StatefulDataLoader))


def _wrap_stateful(tracer: Tracer, patches: Patches, cls) -> None:
    patches.replace(cls, "__init__", lambda original: tracer.live.tracking_loader(original, tracer.attempt))
    patches.replace(cls, "__iter__", lambda original: iterating(tracer, original))


def saving(tracer: Tracer, original):
    def traced(obj, f, *args, **kwargs):
        if tracer.inside:  # a save within a traced one (DCP writes some items with torch.save)
            return original(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            tracer.attempt("the files it writes", tracer.files.before_write, f)
        with tracer.within():
            result = original(obj, f, *args, **kwargs)
        tracer.attempt("the checkpoints saved", lambda: tracer.on_save(obj, file_path(f)))
        return result

    return traced


def loading(tracer: Tracer, original):
    def traced(f, *args, **kwargs):
        if not tracer.inside:
            tracer.attempt("the checkpoints loaded", lambda: tracer.on_load(file_path(f)))
        with tracer.within():
            return original(f, *args, **kwargs)

    return traced


def renaming(tracer: Tracer, original):
    def traced(source, target, *args, **kwargs):
        tracer.attempt("the files it writes", tracer.files.before_write, target)
        result = original(source, target, *args, **kwargs)
        tracer.attempt("the files it writes", tracer.on_rename, source, target)
        return result

    return traced


def _wrap_files(tracer: Tracer, patches: Patches) -> None:
    for owner in (torch, torch.serialization):
        patches.replace(owner, "save", lambda original: saving(tracer, original))
        patches.replace(owner, "load", lambda original: loading(tracer, original))
    for name in ("replace", "rename"):
        patches.replace(os, name, lambda original: renaming(tracer, original))
    patches.replace(shutil, "move", lambda original: renaming(tracer, original))  # across devices it copies
    # Wrapped once the script imports them, not imported here: DCP takes half a second to import, and the
    # tracer imports nothing the script does not (safetensors, say)
    after_import(tracer, patches, "torch.distributed.checkpoint", lambda module: _wrap_dcp(tracer, patches, module))
    after_import(tracer, patches, "safetensors.torch", lambda module: _wrap_safetensors(tracer, patches, module))
    # exactresume's own lines (the Accelerate one) publish a checkpoint folder over an older one by an
    # atomic exchange (renameat2, through ctypes), which no hook of os sees: the same as a rename here.
    after_import(tracer, patches, "exactresume.atomic", lambda module: _wrap_exchange(tracer, patches, module))


def _wrap_exchange(tracer: Tracer, patches: Patches, module) -> None:
    if hasattr(module, "_exchange"):
        patches.replace(module, "_exchange", lambda original: renaming(tracer, original))


def _wrap_safetensors(tracer: Tracer, patches: Patches, module) -> None:
    patches.replace(module, "save_file", lambda original: saving(tracer, original))
    patches.replace(module, "load_file", lambda original: loading(tracer, original))


def after_import(tracer: Tracer, patches: Patches, name: str, wrap: Callable) -> None:
    """`wrap(module)` as soon as the module `name` is imported (now, if it is already)."""

    def then(module) -> None:
        tracer.attempt("the checkpoints saved", wrap, module)

    if name in sys.modules:
        then(sys.modules[name])
        return
    finder = AfterImport(name, then)
    sys.meta_path.insert(0, finder)
    patches.undo.append(lambda: finder in sys.meta_path and sys.meta_path.remove(finder))


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


def _dcp_path(kwargs: dict, role: str) -> str | None:
    """The folder a torch.distributed.checkpoint save or load names (checkpoint_id, or its storage's path)."""
    where = kwargs.get("checkpoint_id") or getattr(kwargs.get(role), "path", None)
    return os.path.abspath(where) if isinstance(where, (str, os.PathLike)) else None


def _wrap_dcp(tracer: Tracer, patches: Patches, module) -> None:
    def saving_dcp(original):
        def traced(state_dict, *args, **kwargs):
            where = tracer.attempt("the checkpoints saved", _dcp_path, kwargs, "storage_writer")
            tracer.attempt("the files it writes", tracer.files.before_write, where)
            with tracer.within():
                result = original(state_dict, *args, **kwargs)
            folder = tracer.attempt("what the checkpoints hold", dcp.parts, where) if where else None
            tracer.attempt("the checkpoints saved", tracer.on_save, state_dict, where, folder)
            return result

        return traced

    def loading_dcp(original):
        def traced(state_dict, *args, **kwargs):
            where = tracer.attempt("the checkpoints loaded", _dcp_path, kwargs, "storage_reader")
            tracer.attempt("the checkpoints loaded", tracer.on_load, where)
            with tracer.within():
                return original(state_dict, *args, **kwargs)

        return traced

    patches.replace(module, "save", saving_dcp)
    patches.replace(module, "load", loading_dcp)
