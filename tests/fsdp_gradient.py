"""Run by test_fsdp, alone and under torchrun: one FSDP2 backward of a fixed batch, its full gradient saved.

    python tests/fsdp_gradient.py OUT.pt                                                     # one process
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp_gradient.py OUT.pt

The gradient is compared against the one-process one, not only against itself: gloo's AVG
reduction under FSDP2 was reported to give gradients N times too large (pytorch #162338), which
AdamW and clipping would hide from a comparison of weights.
"""

from __future__ import annotations

import gc
import sys

import torch

from exactresume.cli import exit_as_rank
from exactresume.config import TrainConfig
from exactresume.core.batches import Batch
from exactresume.core.model import MiniMindLM
from exactresume.parallel.fsdp import ShardedReplicas
from exactresume.parallel.replicas import OneProcess, process_group
from exactresume.world import World

CONFIG = TrainConfig(batch=4, seq_len=16)


def main(out: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = torch.randint(
        0, CONFIG.model.vocab_size, (CONFIG.batch, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    batch = Batch(torch.arange(CONFIG.batch), rows[:, :-1], rows[:, 1:])
    with process_group(World.from_env()) as world:
        gradient = full_gradient(batch, world)
        gc.collect()  # FSDP's hooks keep the model in reference cycles: collect it while the group is up
        if world.is_main:
            torch.save(gradient, out)


def full_gradient(batch: Batch, world: World) -> dict[str, torch.Tensor]:
    """One backward's gradient, whole. The sharded model is gone when this returns, before the
    process group is torn down, as in `exactresume train` (its Run is dropped inside the group)."""
    model = MiniMindLM(CONFIG.model)
    optimizer = torch.optim.AdamW(model.parameters())
    replica = OneProcess(model) if world.size == 1 else ShardedReplicas(model, optimizer, world)
    replica.gradient(batch, CONFIG, lambda inputs, targets, share, index: _backward(replica, inputs, targets, share))
    return {name: _whole(param.grad) for name, param in model.named_parameters()}


def _backward(replica, inputs: torch.Tensor, targets: torch.Tensor, share: float) -> float:
    loss = replica.loss(inputs, targets)
    (loss * share).backward()
    return loss.item()


def _whole(gradient: torch.Tensor) -> torch.Tensor:
    return gradient.full_tensor() if hasattr(gradient, "full_tensor") else gradient


if __name__ == "__main__":
    main(sys.argv[1])
    exit_as_rank(0)  # as exactresume's ranks end: gloo's threads can abort a rank in interpreter teardown
