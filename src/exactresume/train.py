"""The training loop: build a run's state from its config, then step. Knows nothing about files.

A run's whole state is its named parts (`Run.parts()`); the loop reads the global step from
the `step` part and computes the learning rate from it, so a resumed run continues the schedule
where it stopped instead of starting it over.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .batches import RandomWindows
from .config import ModelConfig, TrainConfig
from .data import TokenData
from .model import MiniMindLM
from .parts import GlobalRng, RunIdentity, Stateful, StepCounter

if TYPE_CHECKING:
    from .distributed import Replicas


def lr_at(step: int, total: int, peak: float) -> float:
    """MiniMind's cosine schedule at 0-based global `step` of `total`: from peak down to 0.1 * peak."""
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))


@dataclass
class StepRecord:
    """What one optimizer step did: its 1-based number, loss, and the windows it trained on."""

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
    batches: RandomWindows
    rng: GlobalRng
    identity: RunIdentity
    # Set under many processes (distributed.World.replicate): the DDP-wrapped loss, whose backward
    # averages gradients over ranks, and the mean of the logged loss over ranks.
    replicas: Replicas | None = None

    def parts(self) -> dict[str, Stateful]:
        return {"config": self.identity, "model": self.model, "optimizer": self.optimizer,
                "step": self.step, "gen_state": self.batches, "rng": self.rng}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def run_identity(config: TrainConfig, data: TokenData) -> dict:
    """The fields that must match for a resume to continue the same run."""
    return {"train": config.to_dict(), "model": model_config(config, data).to_dict(), "data": data.fingerprint}


def model_config(config: TrainConfig, data: TokenData) -> ModelConfig:
    """The preset's shape with the tokenizer's vocabulary (a user's tokenizer may not have 6400)."""
    return replace(config.model, vocab_size=data.manifest.vocab_size)


def build_run(config: TrainConfig, data: TokenData) -> Run:
    """A fresh run: seeded globals, initialised model, AdamW, step 0, a seeded batch generator."""
    seed_everything(config.seed)
    model = MiniMindLM(model_config(config, data))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    batches = RandomWindows(data.train, config.batch, config.seq_len, config.seed)
    return Run(config, model, optimizer, StepCounter(0), batches, GlobalRng(), RunIdentity(run_identity(config, data)))


def train_step(run: Run) -> StepRecord:
    """One optimizer step at the run's current global step."""
    lr = lr_at(run.step.value, run.config.steps, run.config.lr)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    starts = run.batches.draw_starts()
    inputs, targets = run.batches.windows(run.batches.local(starts))
    run.model.train()
    loss = run.replicas.loss(inputs, targets) if run.replicas else run.model.loss(inputs, targets)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.config.grad_clip)
    run.optimizer.step()
    run.step.value += 1
    return StepRecord(run.step.value, (run.replicas.mean(loss) if run.replicas else loss).item(), starts)


def train(run: Run, until: int, on_step: Callable[[StepRecord], None] = lambda record: None) -> None:
    """Step until the global step reaches `until`, calling `on_step` after each step."""
    while run.step.value < until:
        on_step(train_step(run))
