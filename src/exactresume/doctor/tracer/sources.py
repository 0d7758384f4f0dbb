"""The random sources a step may draw from besides the global RNGs (fingerprint.rng_digests): every
`random.Random` and numpy `Generator` or `RandomState` the script makes, and the `torch.Generator`s it
holds, each fingerprinted on its own before every optimizer step.

Each is named as the script names it where the tracer can see it: a variable of the script's module or
of the functions on the stack as the optimizer steps (`rng`), or an attribute of an object one of those
holds, or of a DataLoader's sampler, dataset or collate function (`ShuffleSampler.rng`); else by its
kind and the order it was made in (`random.Random #2`). `random.Random`'s constructor is wrapped from the
start and numpy's `default_rng` once the script imports numpy; instances made otherwise are found by the
same look through the script's names, made at its first step and again after a new one was made.
"""

from __future__ import annotations

import random
import sys
import types
import weakref
from pathlib import Path

import torch

from . import fingerprint as fp

LIMIT = 16  # sources fingerprinted a step at most: a script that made one a sample would pay for each
FRAMES = 8  # the script's own frames looked through, outward from the optimizer's step
KINDS = ("random.Random", "numpy.random.Generator", "numpy.random.RandomState", "torch.Generator")
PREFIX = "src:"  # a step record's key for a source: src:LABEL
NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class Sources:
    """The sources seen so far, in the order seen, each with the name found for it (None until found)."""

    def __init__(self):
        self.seen: list[tuple[weakref.ref | object, str, list[str | None]]] = []  # (reference, kind, [name])
        self.ids: dict[int, int] = {}  # id(source) -> its index in `seen`
        self.fresh = True  # a source made since the last look

    def made(self, source, caller) -> None:
        """A source a wrapped constructor just made, called from frame `caller`: kept where the script's own
        code made it (not a library's: tempfile's names), and named at the next look."""
        if _own_code(caller.f_code.co_filename):
            self.add(source)
            self.fresh = True

    def add(self, source, name: str | None = None) -> None:
        kind = _kind_of(source)
        if kind is None or _is_global(source):
            return
        index = self.ids.get(id(source))
        if index is None or resolve(self.seen[index][0]) is not source:
            self.ids[id(source)] = len(self.seen)
            self.seen.append((reference(source), kind, [name]))
        elif name and not self.seen[index][2][0]:
            self.seen[index][2][0] = name

    def digests(self, loaders, frame) -> dict[str, str]:
        """`src:LABEL` -> the state's fingerprint, for each source alive; a look first where one is new."""
        if self.fresh:
            self.fresh = False
            self.look(loaders, frame)
        found, counts = {}, {}
        for held, kind, (name,) in self.seen:
            counts[kind] = counts.get(kind, 0) + 1
            source = resolve(held)
            if source is None or len(found) >= LIMIT:
                continue
            label = f"{name} ({kind})" if name else f"{kind} #{counts[kind]}"
            found[PREFIX + label] = _state_digest(source, kind)
        return found

    def look(self, loaders, frame) -> None:
        """Name what the script's variables and their attributes hold, one level down."""
        for name, value in roots(loaders, frame):
            self.add(value, name)
            if _has_attributes(value):
                for attribute, held in list(vars(value).items()):
                    self.add(held, f"{name}.{attribute}")


def roots(loaders, frame) -> list[tuple[str, object]]:
    """The script's named values: its module's variables, the locals of its frames on the stack, and the
    parts of its DataLoaders (named by their class)."""
    found: list[tuple[str, object]] = []
    main = sys.modules.get("__main__")
    found += [(name, value) for name, value in list(vars(main).items()) if not name.startswith("__")] if main else []
    own = 0
    while frame is not None and own < FRAMES:
        if _own_code(frame.f_code.co_filename):
            own += 1
            found += [(name, value) for name, value in list(frame.f_locals.items()) if name != "self"]
        frame = frame.f_back
    for loader in loaders:
        parts = (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None), loader.dataset)
        found += [(type(part).__name__, part) for part in (*parts, loader.collate_fn) if part is not None]
    return found


OURS = str(Path(__file__).parents[2])  # exactresume's own code, wherever it is installed


def _own_code(filename: str) -> bool:
    """A frame of the script's, not of Python's, torch's, an installed package's or exactresume's."""
    if filename.startswith(OURS):
        return False
    return not any(marker in filename for marker in ("site-packages", "dist-packages", "/lib/python", "<frozen"))


def _has_attributes(value) -> bool:
    """An object of the script's whose attributes may hold a source: not a class, module or function."""
    return hasattr(value, "__dict__") and not isinstance(value, NOT_HOLDERS)


def _kind_of(value) -> str | None:
    if isinstance(value, random.Random):
        return "random.Random"
    if isinstance(value, torch.Generator):
        return "torch.Generator"
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):
        if isinstance(value, numpy.random.Generator):
            return "numpy.random.Generator"
        if isinstance(value, numpy.random.RandomState):
            return "numpy.random.RandomState"
    return None


def _is_global(value) -> bool:
    """The global RNGs, fingerprinted on their own (fingerprint.rng_digests)."""
    numpy = sys.modules.get("numpy")
    legacy = getattr(getattr(getattr(numpy, "random", None), "mtrand", None), "_rand", None)
    return value is random._inst or value is torch.default_generator or value is legacy


def reference(source):
    try:
        return weakref.ref(source)
    except TypeError:  # a torch.Generator takes no weak reference: held (a script's generators live as long)
        return source


def resolve(held):
    return held() if isinstance(held, weakref.ref) else held


def _state_digest(source, kind: str) -> str:
    if kind == "random.Random":
        return fp.python_rng_digest(source)
    if kind == "torch.Generator":
        return fp.digest(source.get_state())
    if kind == "numpy.random.Generator":
        return fp.digest(source.bit_generator.state)
    return fp.digest(list(source.get_state()))


def wrap_constructors(sources: Sources, replace, guard, after_import) -> None:
    """random.Random's constructor now; numpy's default_rng once the script imports numpy.random."""

    def init(original):
        def traced(self, *args, **kwargs):
            original(self, *args, **kwargs)
            guard("the random sources", sources.made, self, sys._getframe(1))

        return traced

    def default_rng(original):
        def traced(*args, **kwargs):
            made = original(*args, **kwargs)
            guard("the random sources", sources.made, made, sys._getframe(1))
            return made

        return traced

    replace(random.Random, "__init__", init)
    after_import("numpy.random", lambda module: replace(module, "default_rng", default_rng))
