"""The live stateful objects of a training process, and which of them a saved checkpoint holds.

Constructors of LR schedulers, GradScalers and DataLoaders are wrapped to keep weak references to
each instance; optimizers and models are found by the hooks (the optimizers that step, the
outermost modules with parameters that run forward). `coverage` compares a saved object with them
by content: a live state counts as saved when the file holds tensors with the same bytes (or the
same fields, for schedulers and scalers).
"""

from __future__ import annotations

import weakref

import torch

from .fingerprint import HALF_DTYPES, dicts_in, digest, tensors_in


class Live:
    """Weak sets of the stateful objects seen so far."""

    def __init__(self):
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.schedulers: weakref.WeakSet = weakref.WeakSet()
        self.scalers: weakref.WeakSet = weakref.WeakSet()
        self.loaders: weakref.WeakSet = weakref.WeakSet()

    def install(self, replace) -> None:
        """Wrap the constructors through `replace(owner, name, make_wrapper)` (install.Patches)."""
        from torch.optim.lr_scheduler import LRScheduler

        for cls, registry in (
            (LRScheduler, self.schedulers),
            (torch.amp.GradScaler, self.scalers),
            (torch.utils.data.DataLoader, self.loaders),
        ):
            replace(cls, "__init__", lambda original, registry=registry: tracking(original, registry))

    def dropout(self) -> bool:
        """Whether a model draws random numbers in its forward (a dropout with p > 0)."""
        kinds = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.AlphaDropout)
        return any(isinstance(m, kinds) and m.p > 0 for model in self.models for m in model.modules())

    def data_state(self) -> list:
        """Per DataLoader: its sampler's kind, epoch (DistributedSampler) and generator states."""
        rows = []
        for loader in list(self.loaders):
            sampler = getattr(loader, "sampler", None)
            gens = [g for g in (loader.generator, getattr(sampler, "generator", None)) if g is not None]
            rows.append(
                [type(sampler).__name__, getattr(sampler, "epoch", None), [digest(g.get_state()) for g in gens]]
            )
        return rows


def tracking(original, registry: weakref.WeakSet):
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        registry.add(self)

    return init


def loader_source(loader) -> str:
    """Where a DataLoader's order comes from, in words."""
    sampler = getattr(loader, "sampler", None)
    kind = type(sampler).__name__
    if hasattr(sampler, "set_epoch"):
        return f"a DataLoader over a {kind} (order from its seed and set_epoch's epoch)"
    if getattr(sampler, "generator", None) is not None or loader.generator is not None:
        return f"a DataLoader over a {kind} (order from the torch.Generator passed as generator=)"
    if kind == "RandomSampler":
        return f"a DataLoader over a {kind} (order drawn from the global torch RNG at each epoch's start)"
    return f"a DataLoader over a {kind}"


def coverage(saved, live: Live) -> list[dict]:
    """One row per live stateful object: its kind, its class, whether `saved` holds its state, and why not."""
    held = {digest(t) for _, t in tensors_in(saved)}
    halves = {(tuple(t.shape)) for _, t in tensors_in(saved) if str(t.dtype) in HALF_DTYPES}
    dicts = list(dicts_in(saved))
    rows = [model_row(m, held, halves) for m in list(live.models)]
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
    states = {tuple(t.shape) for _, t in tensors_in(saved) if t.dtype == torch.uint8}
    for loader in list(live.loaders):
        rows.extend(loader_rows(loader, states))
    if live.dropout():
        found = digest(torch.get_rng_state()) in held
        rows.append(
            {"kind": "global_rng", "name": "torch RNG (dropout)", "saved": found, "detail": "" if found else NO_RNG}
        )
    return rows


NO_RNG = "torch.get_rng_state() is not in the file, and a dropout draws from it"


def row(kind: str, obj, saved: bool, detail: str) -> dict:
    return {"kind": kind, "name": type(obj).__name__, "saved": bool(saved), "detail": detail}


def model_row(model, held: set, halves: set) -> dict:
    state = model.state_dict()
    missing = [k for k, t in state.items() if digest(t) not in held]
    if not missing:
        return row("model", model, True, "")
    rounded = [k for k in missing if tuple(state[k].shape) in halves]
    if rounded:
        return row("model", model, False, f"{len(rounded)} of {len(state)} tensors stored in half precision")
    return row("model", model, False, f"{len(missing)} of {len(state)} tensors not in the file")


def loader_rows(loader, states: set) -> list[dict]:
    """A DataLoader's generators count as saved when the file holds a generator state (a uint8 tensor
    of that size): a script may rightly keep the state at the epoch's start rather than the current one."""
    sampler = getattr(loader, "sampler", None)
    rows = []
    gens = (("generator", loader.generator), ("sampler generator", getattr(sampler, "generator", None)))
    for index, (where, gen) in enumerate(gens):
        if gen is not None and not (index and gen is loader.generator):
            found = tuple(gen.get_state().shape) in states
            detail = "" if found else f"the {where}'s get_state() is not in the file"
            rows.append({"kind": "generator", "name": f"DataLoader {where}", "saved": found, "detail": detail})
    return rows
