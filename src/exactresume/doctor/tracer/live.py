"""The live stateful objects of a training process, and which of them a saved checkpoint holds.

Constructors of LR schedulers, GradScalers and DataLoaders are wrapped to keep weak references to
each instance; optimizers and models are found by the hooks (the optimizers that step, the
outermost modules with parameters that run forward). `coverage` compares a saved object with them
by content: a live state counts as saved when the file holds tensors with the same bytes (or the
same fields, for schedulers and scalers).
"""

from __future__ import annotations

import sys
import weakref
from collections import deque

import torch

from . import order, streams
from .fingerprint import HALF_DTYPES, dicts_in, digest, tensors_in


class Live:
    """Weak sets of the stateful objects seen so far, and the DataLoaders' iterators."""

    def __init__(self):
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self.scalers: weakref.WeakSet = weakref.WeakSet()
        self.loaders: weakref.WeakSet = weakref.WeakSet()
        self.wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> who built it
        self.iterated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> states at each epoch start
        self.began: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> states before each iterator
        self.of_iterator: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # iterator -> its loader
        self.seeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> fresh_seed per epoch
        self.current = None  # a weak reference to the loader whose iterator yielded last
        # the torch RNG's states at the moments the tracer sees (each step, each training forward's end): a
        # file holding one of them holds the RNG as the script kept it (before a prefetch drew, say)
        self.rng_seen: deque[str] = deque(maxlen=32)
        self.read: weakref.WeakSet = weakref.WeakSet()  # modules with parameters run without training
        self.modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its (prefix, module)s
        self.outer: tuple[int, list] = (-1, [])  # the outermost models, as of that many models seen

    def buffers(self) -> str:
        """A digest of the saved buffers (not the non-persistent ones) of the outermost models that train,
        by name: the same in every run, whatever order the set of models iterates in."""
        if self.outer[0] != len(self.models):
            self.outer = (len(self.models), outermost(list(self.models)))
        digests = []
        for model in self.outer[1]:
            if model not in self.modules:  # its modules listed once
                self.modules[model] = list(model.named_modules())
            named = [
                (f"{prefix}.{n}" if prefix else n, b)
                for prefix, m in self.modules[model]
                for n, b in m._buffers.items()
                if b is not None and n not in m._non_persistent_buffers_set
            ]
            digests.append(digest(sorted(named, key=lambda nb: nb[0])))
        return digest(sorted(digests))

    def read_only(self) -> list:
        """The outermost modules with parameters that ran forward without training and are no part of a model
        that trains: a frozen or averaged copy of the model that the loss reads (or one only evaluated)."""
        trained = {id(m) for model in list(self.models) for m in model.modules()}
        return outermost([m for m in list(self.read) if id(m) not in trained])

    def saw_rng(self) -> None:
        self.rng_seen.append(digest(torch.get_rng_state()))

    def install(self, replace, guard) -> None:
        """Wrap the constructors through `replace(owner, name, make_wrapper)` (install.Patches); what they
        record goes through `guard(what, action, *args)` (the tracer's attempt)."""
        from torch.optim.lr_scheduler import LRScheduler

        for cls, registry in ((LRScheduler, self.schedulers), (torch.amp.GradScaler, self.scalers)):
            replace(cls, "__init__", lambda original, registry=registry: tracking(original, registry, guard))
        replace(torch.utils.data.DataLoader, "__init__", lambda original: self.tracking_loader(original, guard))

    def tracking_loader(self, original, guard):
        def init(loader, *args, **kwargs):
            original(loader, *args, **kwargs)
            guard("the DataLoaders", self.track_loader, loader, sys._getframe(1))

        return init

    def track_loader(self, loader, caller) -> None:
        """A new DataLoader, and who built it (`caller`: the frame that called its __init__)."""
        self.loaders.add(loader)
        wrapper = order.wrapper_of(loader, caller)
        if wrapper is not None:
            self.wrappers[loader] = wrapper

    def states(self, loader) -> list[str]:
        return [digest(g.get_state()) for _, g in order.generators(loader)]

    def on_iterator(self, loader, iterator, began: list[str] | None = None) -> None:
        """A new epoch's iterator: remember the generators' states as the epoch starts, and `began`, theirs
        before the iterator was made (which draws the workers' base seed from the DataLoader's generator)."""
        self.iterated.setdefault(loader, []).append(self.states(loader))
        self.began.setdefault(loader, []).extend(began or [])
        self.of_iterator[iterator] = loader

    def note_seeds(self, loader) -> None:
        """As an epoch's iterator is about to be made: which of its generators were just seeded, and with what."""
        self.seeds.setdefault(loader, []).append([_fresh_seed(g) for _, g in order.generators(loader)])

    def on_fetch(self, iterator) -> None:
        loader = self.of_iterator.get(iterator)
        if loader is not None:
            self.current = weakref.ref(loader)

    def drawing(self) -> list:
        """The loaders iterated so far, the one that yielded last first."""
        current = self.current() if self.current else None
        rest = [loader for loader in list(self.iterated) if loader is not current]
        return ([current] if current is not None else []) + rest

    def describe(self, loader) -> str:
        return order.describe(loader, self.wrappers.get(loader))

    def dropout(self) -> bool:
        """Whether a model draws random numbers in its forward (a dropout with p > 0)."""
        kinds = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.AlphaDropout)
        return any(isinstance(m, kinds) and m.p > 0 for model in self.models for m in model.modules())

    def data_state(self) -> list:
        """The drawing sampler of the loader that yielded last: its kind, epoch and generator states."""
        drawing = self.drawing()[:1] or list(self.loaders)
        return [order.state(loader) for loader in drawing]


def outermost(modules: list) -> list:
    """The modules no other of `modules` holds."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _fresh_seed(gen: torch.Generator) -> int | None:
    """The seed a generator was just set to (its state is manual_seed(initial_seed())'s), else None."""
    seed = gen.initial_seed()
    return seed if torch.equal(torch.Generator().manual_seed(seed).get_state(), gen.get_state()) else None


def reseeded(loader, live: Live, index: int) -> bool:
    """The loader's generator `index` was set to a new seed as each epoch began (the seed and the epoch
    rebuild its state: a script that saves them need not save the state)."""
    seeds = [epoch[index] if index < len(epoch) else None for epoch in live.seeds.get(loader, [])]
    return len(seeds) > 1 and None not in seeds and len(set(seeds)) == len(seeds)


def tracking(original, registry: weakref.WeakSet, guard):
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        guard("the LR schedulers and GradScalers", registry.add, self)

    return init


def coverage(saved, live: Live) -> list[dict]:
    """One row per live stateful object: its kind, its class, whether `saved` holds its state, and why not."""
    held = {digest(t) for _, t in tensors_in(saved)}
    halves = {(tuple(t.shape)) for _, t in tensors_in(saved) if str(t.dtype) in HALF_DTYPES}
    dicts = list(dicts_in(saved))
    rows = [_model_row(m, held, halves) for m in list(live.models)]
    rows += [_read_row(m, held) for m in live.read_only()]
    for opt in list(live.optimizers):
        found = any("state" in d and "param_groups" in d for d in dicts)
        tensors = [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        exact = found and all(digest(t) in held for t in tensors)
        rows.append(row("optimizer", opt, exact, "" if exact else "its state_dict() is not in the file"))
    for sched in list(live.schedulers):
        found = any("last_epoch" in d and d.get("last_epoch") == sched.last_epoch for d in dicts)
        rows.append(row("lr_scheduler", sched, found, "" if found else "its state_dict() is not in the file"))
    for scaler in [s for s in list(live.scalers) if s.is_enabled()]:
        found = any("_growth_tracker" in d and "scale" in d for d in dicts)
        rows.append(row("grad_scaler", scaler, found, "" if found else "its state_dict() is not in the file"))
    kept = any(TORCHDATA_KEYS & set(d) for d in dicts)  # a StatefulDataLoader's state_dict() is in the file
    for loader in live.drawing():
        rows.extend(_loader_rows(loader, live, held, kept))
        if order.iterable(loader):
            rows.extend(streams.rows(loader.dataset, saved, held))
    if live.dropout():
        found = digest(torch.get_rng_state()) in held or any(state in held for state in live.rng_seen)
        rows.append(
            {"kind": "global_rng", "name": "torch RNG (dropout)", "saved": found, "detail": "" if found else NO_RNG}
        )
    return rows


NO_RNG = "torch.get_rng_state() is not in the file, and a dropout draws from it"


def row(kind: str, obj, saved: bool, detail: str) -> dict:
    return {"kind": kind, "name": type(obj).__name__, "saved": bool(saved), "detail": detail}


def _model_row(model, held: set, halves: set) -> dict:
    state = model.state_dict()
    missing = [k for k, t in state.items() if digest(t) not in held]
    if not missing:
        return row("model", model, True, "")
    rounded = [k for k in missing if tuple(state[k].shape) in halves]
    if rounded:
        return row("model", model, False, f"{len(rounded)} of {len(state)} tensors stored in half precision")
    params = {name for name, _ in model.named_parameters()}
    buffers = [k for k in missing if k not in params]
    found = row("model", model, False, f"{len(missing)} of {len(state)} tensors not in the file")
    if buffers and len(buffers) == len(missing):
        found["detail"] = f"its buffers are not in the file: {', '.join(buffers[:4])}" + (" ..." * (len(buffers) > 4))
    return found | {"buffers": buffers}


def _read_row(module, held: set) -> dict:
    """A module the forward runs without training: saved when the file holds every tensor of its state."""
    state = module.state_dict()
    missing = [k for k, t in state.items() if digest(t) not in held]
    name = f"{type(module).__name__} {_main_name(module)}".rstrip()
    detail = f"{len(missing)} of {len(state)} tensors not in the file" if missing else ""
    return {"kind": "forward_module", "name": name, "saved": not missing, "detail": detail}


def _main_name(obj) -> str:
    """The script's own name for `obj` (a global of __main__), in quotes, or ''."""
    names = [k for k, v in vars(sys.modules.get("__main__", sys)).items() if v is obj and not k.startswith("_")]
    return f"'{names[0]}'" if names else ""


# The keys of torchdata's StatefulDataLoader state_dict(), with its workers and without
TORCHDATA_KEYS = {"_snapshot", "_sampler_iter_state", "_index_sampler_state"}


def _loader_rows(loader, live: Live, held: set, kept: bool = False) -> list[dict]:
    """A loader's generators count as saved when the file holds the bytes of their state now or at the
    start of an epoch, before or after its iterator was made (a script may rightly keep the state an
    epoch began with); a torchdata sampler's, when the file holds its StatefulDataLoader's state_dict()
    (`kept`): its iterator saves the generator as it began, which with workers is after a first draw; and
    a generator reseeded with a new seed as each epoch began (`reseeded`)."""
    rows = []
    starts = [state for epoch in live.iterated.get(loader, []) for state in epoch] + live.began.get(loader, [])
    sampler = order.drawer(loader)
    for index, (where, gen) in enumerate(order.generators(loader)):
        own = (
            kept and order.stateful(loader) and not order.unkept(sampler) and gen is getattr(sampler, "generator", None)
        )
        found = own or reseeded(loader, live, index) or digest(gen.get_state()) in held
        found = found or any(state in held for state in starts)
        detail = "" if found else f"the {where} state (get_state()) is not in the file"
        rows.append({"kind": "generator", "name": where, "saved": found, "detail": detail})
    return rows
