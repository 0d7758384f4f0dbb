"""The tracer's hooks: one fingerprint record per optimizer step, one record per checkpoint save and load.

Environment (set by the doctor):
    EXACTRESUME_DOCTOR_TRACE       folder for this process's trace (trace-PID.jsonl, weights-PID.f32)
    EXACTRESUME_DOCTOR_LIMIT       end the process as optimizer step LIMIT+1 begins (exit code CUT)
    EXACTRESUME_DOCTOR_CRASH_FROM  end it abruptly (exit code CRASH) as the first optimizer step
                                   after a checkpoint saved at or after this step begins; under
                                   torchrun every rank ends at that step (a marker in the folder)
    EXACTRESUME_DOCTOR_KEEP        copy a path that was there before this process into this folder
                                   before it is changed, replaced or deleted (the doctor puts it back)
    EXACTRESUME_DOCTOR_OUT         the doctor's own folder: writes there are not reported
    EXACTRESUME_DOCTOR_PID         the doctor's process: once it is gone (killed), end at the next step
                                   (exit code CUT) rather than go on writing into the user's folders

A record per step holds the fingerprints of: the batch (the inputs of the outermost training
forward calls of the step), each param group's lr and hyperparameters, the parameters before the
step, the gradients, the optimizer state after it (these three in the models' order: prints.py), the
RNG states, the drawing sampler's state, the GradScalers' state, the trained models' buffers after the
forward and the optimizer's layout (its groups' parameter names); plus the loss passed to backward()
and what drew from the global torch RNG since the last step. A closure-style step
(`optimizer.step(closure)`, as Lightning and LBFGS do) gets the batch, loss and gradients of the
forward and backward its closure runs first.

Each fingerprint is computed on its own, through the guard (guard.py): one that fails is reported
once, from its step on, and the others go on; the step is counted whatever failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import weakref
from collections import deque

import torch

from . import CRASH, CUT, dcp
from . import fingerprint as fp
from .files import Files
from .guard import Guard
from .live import Live, coverage
from .prints import BEFORE_STEP, Order, buffers, gradients, optimizer_state
from .sources import Sources

FRAMEWORKS = {"transformers": "transformers", "accelerate": "accelerate", "pytorch_lightning": "lightning"}
FRAMEWORKS |= {"lightning": "lightning", "lightning_fabric": "lightning"}
# What a save's record holds when the tracer could not read the saved object.
UNSEEN = {"keys": [], "tensors": [], "live": [], "loaders": [], "held": [], "dropout": False, "framework": None}


class Tracer(Guard):
    def __init__(self, folder: str, limit: int, crash_from: int | None, keep: str | None = None, ignore=None):
        super().__init__()
        self.limit, self.crash_from = limit, crash_from
        self.inside = 0  # > 0 while a traced save or load runs
        os.makedirs(folder, exist_ok=True)
        self.marker = os.path.join(folder, "crash-at")
        self.out = open(os.path.join(folder, f"trace-{os.getpid()}.jsonl"), "w")
        self.weights = open(os.path.join(folder, f"weights-{os.getpid()}.f32"), "wb")
        self.files = Files(self.write, keep, ignore)
        self.live, self.primary, self.step = Live(), None, 0
        self.depth = 0
        self.micro: list[str] = []
        self.losses: list[float] = []
        self.drew: list[str] = []  # what drew from the global torch RNG since the last step
        self.fetched = 0  # batches fetched since the last step
        self.sources = Sources()
        self.doctor_pid: int | None = None  # the doctor that started this run (EXACTRESUME_DOCTOR_PID)
        self.pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # iterator -> index lists drawn
        self.read_indices: list = []  # the index lists of the batches fetched since the last step
        self.record: dict = {}
        self.forwarded = False  # the step's batch and gradients are in its record
        self.idle = False  # the optimizer step under way trains nothing (idle_step): not counted
        self.armed = False
        self.has_params: dict[int, bool] = {}
        self.order, self.layouts = Order(), set()
        self.described = ""
        rank = {name.lower(): int(os.environ[name]) for name in ("RANK", "WORLD_SIZE") if name in os.environ}
        self.write({"event": "start", "pid": os.getpid(), "argv": sys.argv[:1], "hash": fp.HASH} | rank)

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def close(self, record: dict) -> None:
        if not self.out.closed:
            self.write(record)
            self.out.close()
            self.weights.close()

    def end(self, code: int) -> None:
        """End the process now, as a crash would (no atexit, no cleanup), after closing the trace."""
        self.close({"event": "end", "code": code, "steps": self.step})
        os._exit(code)

    # -- forward, backward, data ----------------------------------------------------------------

    def on_forward(self, module, args, kwargs) -> None:
        key = id(module)
        if key not in self.has_params:
            self.has_params[key] = any(True for _ in module.parameters())
        if self.has_params[key] and module.training and torch.is_grad_enabled():
            self.live.models.add(module)
            self.micro.append(fp.digest(args, kwargs))
        elif self.has_params[key]:  # a frozen or averaged copy the loss reads, or an evaluation
            self.live.read.add(module)

    def on_backward(self, tensor) -> None:
        if tensor.numel() == 1:
            self.losses.append(float(tensor.detach().float()))

    def on_iterator(self, loader, iterator, drew: bool, began: list[str] | None = None) -> None:
        """A DataLoader made an iterator (an epoch begins); `drew`: it drew from the global torch RNG;
        `began`: its generators' states before."""
        self.live.on_iterator(loader, iterator, began)
        if drew:
            self.drew.append("iterator")
        generator = getattr(loader, "generator", None) is not None
        states = self.live.iterated[loader][-1]
        described = self.live.describe(loader)
        self.write({"event": "iter", "step": self.step, "drew": drew, "generator": generator, "generators": states})
        if described != self.described:  # once per kind of loader: the doctor names it per rank
            self.described = described
            self.write({"event": "loader", "step": self.step, "loader": described})

    def on_fetch(self, iterator) -> None:
        self.live.on_fetch(iterator)
        self.fetched += 1
        drawn = self.pending.get(iterator)
        if drawn:  # workers hand batches back in the order their index lists were drawn
            self.read_indices.append(drawn.popleft())

    def on_index(self, iterator, index) -> None:
        """An index list the iterator drew from its sampler (ahead of the fetch, with workers)."""
        if index is not None and not (isinstance(index, list) and None in index):  # an IterableDataset's: no index
            self.pending.setdefault(iterator, deque()).append(index)

    def on_draw(self, where: str) -> None:
        self.drew.append(where)

    def on_rng_set(self) -> None:
        """The global torch RNG was set; `fetched`: batches of the coming step fetched before it."""
        self.write({"event": "rng_set", "step": self.step, "fetched": self.fetched})

    # -- optimizer steps ----------------------------------------------------------------------

    def before_step(self, optimizer, args, kwargs):
        self.attempt("the optimizer state", self.live.optimizers.add, optimizer)
        if self.primary is None:
            self.primary = optimizer
        if optimizer is not self.primary:
            return None
        self.idle = bool(self.attempt("the steps that train nothing", idle_step, optimizer, args, kwargs, self.micro))
        if self.idle:
            return None
        if self.armed or (self.crash_from is not None and self.marked()):
            self.end(CRASH)
        if self.doctor_pid is not None and not alive(self.doctor_pid):
            self.end(CUT)
        if self.step >= self.limit:
            self.end(CUT)
        self.record, self.forwarded = {"event": "step", "step": self.step + 1}, False
        params = self.attempt("the parameters' order", self.order.of, optimizer, self.live.models, default=None)
        params = params[0] if params else [p for g in optimizer.param_groups for p in g["params"]]
        for what, fingerprint in BEFORE_STEP:
            self.record |= self.attempt(what, fingerprint, self, optimizer, params, default={})
        # args holds the optimizer itself first, then step()'s own arguments
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            self.attempt("the batch", self.after_forward, params)
            return None
        return self.attempt("the closure's forward", self.with_closure, args, kwargs, self.closing(closure, params))

    def laid_out(self, optimizer, record: dict) -> list:
        """The optimizer's parameters in the models' order; `record` gets the groups' layout, and the trace
        its names the first time it is seen. After the step's forward: a closure's runs inside step()."""
        params, layout, names = self.order.of(optimizer, self.live.models)
        record["layout"] = layout
        if layout not in self.layouts:
            self.layouts.add(layout)
            self.write({"event": "layout", "step": self.step, "layout": layout, "groups": names})
        return params

    def with_closure(self, args, kwargs, wrapped):
        if "closure" in kwargs:
            return args, kwargs | {"closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def closing(self, closure, params):
        """The closure, filling the step's batch and gradients after its first call (LBFGS calls it again)."""

        def traced(*args, **kwargs):
            result = closure(*args, **kwargs)
            if not self.forwarded:
                self.attempt("the batch", self.after_forward, params)
            return result

        return traced

    def after_forward(self, params) -> None:
        self.forwarded = True
        if self.read_indices:  # the samples the step's batches hold: the last fetched, one a forward
            self.record["indices"] = fp.digest(self.read_indices[-max(len(self.micro), 1) :])
        self.record |= {
            "batch": fp.digest(self.micro),
            "micro": list(self.micro),
            "loss": sum(self.losses) if self.losses else None,
            "drew": sorted(set(self.drew)),
        }
        self.record |= self.attempt("the gradients", gradients, params, default={})
        self.record |= self.attempt("the models' buffers", buffers, self.live, default={})

    def after_step(self, optimizer, args, kwargs) -> None:
        if self.primary is None:  # its before_step failed: the step still counts
            self.primary = optimizer
        if optimizer is not self.primary:
            return
        if self.idle:
            self.idle = False
            return
        record = self.record or {"event": "step", "step": self.step + 1}  # {}: its before_step failed
        try:
            params = self.attempt("the parameters' order", self.laid_out, optimizer, record, default=None)
            params = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
            if self.record and not self.forwarded:  # a closure the optimizer never called
                self.attempt("the batch", self.after_forward, params)
            record |= self.attempt("the optimizer state", optimizer_state, optimizer, params, default={})
        finally:  # the step counts whatever failed: the cut and the crash go by the count
            self.step += 1
            self.record, self.forwarded, self.micro, self.losses, self.drew, self.fetched = {}, False, [], [], [], 0
            self.read_indices = []
        self.write(record)

    def marked(self) -> bool:
        """Another rank saved the checkpoint this run ends after: end at the same step it does."""
        if not os.path.exists(self.marker):
            return False
        with contextlib.suppress(OSError, ValueError), open(self.marker) as marker:
            # Empty while the saving rank is writing it (open truncates first; its one write is whole).
            return self.step >= int(marker.read())
        return False

    # -- checkpoint files ---------------------------------------------------------------------

    def on_save(self, obj, path: str | None, folder: dict | None = None) -> None:
        """`folder`: what a DCP folder's metadata says it holds (dcp.parts), for what `obj` does not show."""
        record = {"event": "save", "path": path, "step": self.step, "pending_micro": len(self.micro)}
        found = self.attempt("what the checkpoints hold", self.contents, obj, default=UNSEEN)
        if folder:
            found = found | folder | {"live": dcp.covered(found["live"], folder["keys"], self.live)}
        self.write(record | found)
        if self.crash_from is not None and self.step >= self.crash_from:
            self.armed = True
            with self.files_busy(), open(self.marker, "w") as marker:
                marker.write(str(self.step))

    def contents(self, obj) -> dict:
        """What a saved object holds, and which live stateful objects it lacks."""
        return {
            "keys": fp.top_keys(obj),
            "tensors": fp.summary(obj),
            "live": coverage(obj, self.live),
            "loaders": [self.live.describe(loader) for loader in self.live.drawing()],
            "held": sorted({fp.digest(t) for _, t in fp.tensors_in(obj) if t.dtype == torch.uint8}),
            "dropout": self.live.dropout(),
            "framework": framework(),
        }

    def on_load(self, path: str | None) -> None:
        found = self.attempt("the checkpoints loaded", framework)
        self.write({"event": "load", "path": path, "step": self.step, "framework": found})

    @contextlib.contextmanager
    def within(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    @contextlib.contextmanager
    def files_busy(self):
        self.files.busy += 1
        try:
            yield
        finally:
            self.files.busy -= 1

    def on_rename(self, source, target) -> None:
        self.write({"event": "rename", "source": os.path.abspath(source), "target": os.path.abspath(target)})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's
        return True
    return True


def idle_step(optimizer, args, kwargs, forwards=()) -> bool:
    """A step that trains nothing: no forward since the last step (`forwards`), no closure to run one, and
    every gradient None or zero. DCP's load initialises an empty optimizer state that way (torch's
    _init_optim_state: one step at lr 0 with zero gradients); counting it would shift every later step."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if forwards or callable(closure):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return all(p.grad is None or not bool(p.grad.any()) for p in params)


def framework() -> str | None:
    """The outermost framework on the stack (the one the script called): whose code saves or loads."""
    found, frame = None, sys._getframe(1)
    while frame is not None:
        package = str(frame.f_globals.get("__name__", "")).split(".")[0]
        found = FRAMEWORKS.get(package, found)
        frame = frame.f_back
    return found


def file_path(file) -> str | None:
    """The path a torch.save / torch.load argument names: a path, or an open file's name."""
    if isinstance(file, (str, os.PathLike)):
        return os.path.abspath(file)
    for holder in (file, getattr(file, "file", None), getattr(file, "raw", None), getattr(file, "f", None)):
        name = getattr(holder, "name", None)
        if isinstance(name, str):
            return os.path.abspath(name)
    path = getattr(file, "path", None)  # fsspec's local files
    return os.path.abspath(path) if isinstance(path, str) else None
