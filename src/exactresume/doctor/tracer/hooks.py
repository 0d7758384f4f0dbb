"""The tracer's hooks: one fingerprint record per optimizer step, one record per checkpoint save and load.

Environment (set by the doctor):
    EXACTRESUME_DOCTOR_TRACE       folder for this process's trace (trace-PID.jsonl, weights-PID.f32)
    EXACTRESUME_DOCTOR_LIMIT       end the process as optimizer step LIMIT+1 begins (exit code CUT)
    EXACTRESUME_DOCTOR_CRASH_FROM  end it abruptly (exit code CRASH) as the first optimizer step
                                   after a checkpoint saved at or after this step begins
    EXACTRESUME_DOCTOR_KEEP        copy a file that was there before this process into this folder
                                   before a save or rename replaces it (the doctor puts it back)

A record per step holds the fingerprints of: the batch (the inputs of the outermost training
forward calls since the last step), each param group's lr and hyperparameters, the parameters
before the step, the gradients, the optimizer state after it, the RNG states, the DataLoaders'
sampler state and the GradScalers' state; plus the loss passed to backward().
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch

from . import fingerprint as fp
from .live import Live, coverage, loader_source

CUT = 86  # the process was cut after LIMIT steps, as asked
CRASH = 87  # the process was ended as a crash would end it, right after its checkpoint


class Tracer:
    def __init__(self, folder: str, limit: int, crash_from: int | None, keep: str | None = None):
        self.limit, self.crash_from, self.keep = limit, crash_from, keep
        self.created: set[str] = set()
        self.inside = 0  # > 0 while a traced save or load runs
        os.makedirs(folder, exist_ok=True)
        self.out = open(os.path.join(folder, f"trace-{os.getpid()}.jsonl"), "w")
        self.weights = open(os.path.join(folder, f"weights-{os.getpid()}.f32"), "wb")
        self.live, self.primary, self.step, self.depth = Live(), None, 0, 0
        self.micro: list[str] = []
        self.losses: list[float] = []
        self.record: dict = {}
        self.armed = False
        self.has_params: dict[int, bool] = {}

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

    # -- forward, backward ------------------------------------------------------------------

    def on_forward(self, module, args, kwargs) -> None:
        key = id(module)
        if key not in self.has_params:
            self.has_params[key] = any(True for _ in module.parameters())
        if self.has_params[key] and module.training and torch.is_grad_enabled():
            self.live.models.add(module)
            self.micro.append(fp.digest(args, kwargs))

    def on_backward(self, tensor) -> None:
        if tensor.numel() == 1:
            self.losses.append(float(tensor.detach().float()))

    # -- optimizer steps ----------------------------------------------------------------------

    def before_step(self, optimizer, args, kwargs) -> None:
        self.live.optimizers.add(optimizer)
        if self.primary is None:
            self.primary = optimizer
        if optimizer is not self.primary:
            return
        if self.armed:
            self.end(CRASH)
        if self.step >= self.limit:
            self.end(CUT)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.record = {
            "event": "step",
            "step": self.step + 1,
            "batch": fp.digest(self.micro),
            "micro": list(self.micro),
            "lr": [float(g.get("lr", 0.0)) for g in groups],
            "hparams": fp.digest([{k: v for k, v in g.items() if k != "lr"} for g in groups]),
            "params": fp.digest(params),
            "grads": fp.digest([p.grad for p in params]),
            "data": fp.digest(self.live.data_state()),
            "sampler_epochs": [row[1] for row in self.live.data_state()],
            "scaler": fp.digest([s.state_dict() for s in list(self.live.scalers) if s.is_enabled()]),
            "scale": [float(s.get_scale()) for s in list(self.live.scalers) if s.is_enabled()],
            "loss": sum(self.losses) if self.losses else None,
        } | fp.rng_digests()
        self.weights.write(fp.weight_sample(params).tobytes())

    def after_step(self, optimizer, args, kwargs) -> None:
        if optimizer is not self.primary or not self.record:
            return
        states = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state]
        self.record["optim"] = fp.digest(states)
        counters = [float(s["step"]) for s in states[:1] if "step" in s]
        self.record["optim_step"] = counters[0] if counters else None
        self.step += 1
        self.write(self.record)
        self.record, self.micro, self.losses = {}, [], []

    # -- checkpoint files ---------------------------------------------------------------------

    def on_save(self, obj, path: str | None) -> None:
        self.write(
            {
                "event": "save",
                "path": path,
                "step": self.step,
                "pending_micro": len(self.micro),
                "keys": fp.top_keys(obj),
                "tensors": fp.summary(obj),
                "live": coverage(obj, self.live),
                "loaders": [loader_source(loader) for loader in list(self.live.loaders)],
                "dropout": self.live.dropout(),
            }
        )
        if self.crash_from is not None and self.step >= self.crash_from:
            self.armed = True

    def on_load(self, path: str | None) -> None:
        self.write({"event": "load", "path": path, "step": self.step})

    @contextlib.contextmanager
    def within(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def before_write(self, path: str | None) -> None:
        """Keep a copy of a file (or DCP folder) this process did not write before it is replaced."""
        if path is None or path in self.created:
            return
        self.created.add(path)
        if self.keep and os.path.exists(path):
            os.makedirs(self.keep, exist_ok=True)
            copy = os.path.join(self.keep, f"{os.getpid()}-{len(self.created):03d}-{os.path.basename(path)}")
            (shutil.copytree if os.path.isdir(path) else shutil.copy2)(path, copy)
            self.write({"event": "kept", "path": path, "copy": copy})

    def on_rename(self, source, target) -> None:
        self.write({"event": "rename", "source": os.path.abspath(source), "target": os.path.abspath(target)})


def file_path(file) -> str | None:
    """The path a torch.save / torch.load argument names: a path, or an open file's name."""
    if isinstance(file, str | os.PathLike):
        return os.path.abspath(file)
    for holder in (file, getattr(file, "file", None), getattr(file, "raw", None)):
        name = getattr(holder, "name", None)
        if isinstance(name, str):
            return os.path.abspath(name)
    return None
