"""The training loop: build a run's state from its config, then step. Knows nothing about files.

A run's whole state is its named parts (`Run.parts()`); the loop reads the global step from
the `step` part and computes the learning rate from it, so a resumed run continues the schedule
where it stopped instead of starting it over.

`--batch` counts the sequences of one optimizer step; `--grad-accum N` splits them into N
micro-batches whose gradients add up before the step, so the samples a step trains on do not
depend on N. Each step starts from no gradients, so the state between two steps is complete
without them: resume files are written only there, never inside an accumulation.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from exactresume.config import ModelConfig, TrainConfig
from exactresume.core.batches import RandomWindows
from exactresume.core.data import TokenData
from exactresume.core.epochs import EpochLoader
from exactresume.core.model import MiniMindLM
from exactresume.parallel.exact import ExactReplicas, micro_batch_seed
from exactresume.parallel.fsdp import full_parts
from exactresume.parallel.replicas import OneProcess, Replicas
from exactresume.parts import GlobalRng, StepCounter
from exactresume.training.device import loss_scaler, precision_context, training_device
from exactresume.training.run_identity import RunIdentity
from exactresume.world import World

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


def lr_at(step: int, total: int, peak: float, warmup: int = 0) -> float:
    """At 0-based global `step` of `total`: linear warmup to `peak` over `warmup` steps, then
    MiniMind's cosine from peak down to 0.1 * peak over the remaining steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))))


@dataclass
class StepRecord:
    """What one optimizer step did: its 1-based number, loss, and the windows it trained on (Batch.starts)."""

    step: int
    loss: float
    starts: torch.Tensor


@dataclass
class Run:
    """A training run's live state; `parts()` is exactly what a resume file holds."""

    config: TrainConfig
    model: MiniMindLM
    optimizer: torch.optim.Optimizer
    step: StepCounter
    batches: RandomWindows | EpochLoader
    rng: GlobalRng
    identity: RunIdentity
    scaler: torch.amp.GradScaler
    device: torch.device
    # How this process takes part: its slice of each global batch, the loss it computes (DDP's under
    # many processes, whose backward averages gradients over ranks), the mean of the logged loss.
    # One process is its own replica; parallel.replicate.replicate swaps in DDP's.
    replicas: OneProcess | Replicas | ExactReplicas

    def parts(self) -> dict[str, Stateful]:
        parts = {
            "config": self.identity,
            "model": self.model,
            "optimizer": self.optimizer,
            "step": self.step,
            "gen_state": self.batches,
            "rng": self.rng,
        }
        if self.scaler.is_enabled():  # fp16 only: the loss scale and its growth counter
            parts["scaler"] = self.scaler
        return parts

    def file_parts(self) -> dict[str, Stateful]:
        """The parts as one file holds them: under FSDP2 the model and optimizer gathered whole."""
        return full_parts(self.parts(), self.config.fsdp)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# Fields that decide how fast a run goes, never what it computes: a resume may change them.
RESULT_NEUTRAL_FIELDS = ("workers",)


def _run_identity(config: TrainConfig, data: TokenData) -> dict:
    """The fields that must match for a resume to continue the same run."""
    return {"train": _result_fields(config), "model": model_config(config, data).to_dict(), "data": data.fingerprint}


def _result_fields(config: TrainConfig) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in RESULT_NEUTRAL_FIELDS}


def _identity_part(config: TrainConfig, data: TokenData) -> RunIdentity:
    """The `config` part; a file written before a field existed is read with that field's default."""
    return RunIdentity(_run_identity(config, data), defaults={"train": _result_fields(TrainConfig())})


def model_config(config: TrainConfig, data: TokenData) -> ModelConfig:
    """The preset's shape with the tokenizer's vocabulary (a user's tokenizer may not have 6400)."""
    return replace(config.model, vocab_size=data.manifest.vocab_size)


def _make_loader(config: TrainConfig, data: TokenData) -> RandomWindows | EpochLoader:
    """The run's batch source, seeded; its state is the `gen_state` part."""
    if config.loader == "epoch":
        return EpochLoader(data.train, config.batch, config.seq_len, config.seed, config.workers)
    return RandomWindows(data.train, config.batch, config.seq_len, config.seed)


def build_run(config: TrainConfig, data: TokenData) -> Run:
    """A fresh run: seeded globals, initialised model, AdamW, step 0, a seeded batch source."""
    device = training_device(config)
    seed_everything(config.seed)
    torch.set_num_threads(config.threads)
    model = MiniMindLM(model_config(config, data)).to(device)  # initialised on the CPU: the same on every device
    # fused: one kernel per parameter for the whole update instead of about ten elementwise passes.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True)
    return Run(
        config,
        model,
        optimizer,
        StepCounter(0),
        _make_loader(config, data),
        GlobalRng(),
        _identity_part(config, data),
        loss_scaler(config, device),
        device,
        ExactReplicas(model, World()) if config.micro_batch else OneProcess(model),
    )


def train_step(run: Run) -> StepRecord:
    """One optimizer step at the run's current global step: the replica fills the gradient, then one update."""
    config = run.config
    lr = lr_at(run.step.value, config.steps, config.lr, config.warmup)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = run.batches.next_batch()  # the global batch: what the step trains on does not depend on N
    run.model.train()
    run.optimizer.zero_grad(set_to_none=True)
    loss = run.replicas.gradient(batch, config, lambda *micro: micro_step(run, *micro))
    run.scaler.unscale_(run.optimizer)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.step.value += 1
    return StepRecord(run.step.value, loss, batch.starts)


def micro_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, share: float, index: int) -> float:
    """Forward and backward of one micro-batch; its loss. The gradient lands in .grad, weighted by `share`."""
    with _micro_batch_randomness(run, index), precision_context(run.config, run.device):
        micro_loss = run.replicas.loss(inputs.to(run.device), targets.to(run.device))
    # Weighting by share makes the summed gradient that of the mean over the step's sequences.
    run.scaler.scale(micro_loss * share).backward()
    return micro_loss.item()


def _micro_batch_randomness(run: Run, index: int) -> contextlib.AbstractContextManager:
    """In the N-independent mode, dropout draws from a stream keyed by (seed, step, micro-batch), not the rank's."""
    if not run.config.micro_batch:
        return contextlib.nullcontext()
    return _keyed_rng(micro_batch_seed(run.config.seed, run.step.value, index), run.device)


@contextlib.contextmanager
def _keyed_rng(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def train(run: Run, until: int, on_step: Callable[[StepRecord], None] = lambda record: None) -> None:
    """Step until the global step reaches `until`, calling `on_step` after each step."""
    while run.step.value < until:
        on_step(train_step(run))
