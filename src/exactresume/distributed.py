"""Many processes: one run as N replicas under torch.distributed (DistributedDataParallel).

    exactresume train ... --nproc 2                                # relaunches itself under torchrun
    torchrun --nproc-per-node 2 -m exactresume.cli -- train ...   # or launch it yourself (multi-node too)

The global batch stays `--batch`: every rank draws the whole global batch of window starts from
the same generator state and trains on its own slice, so the samples seen are a function of the
seed and the global step, never of N. Gradients are averaged by DDP. Only rank 0 writes files.
What differs per rank (the batch generator, the RNGs) is gathered into the resume file as a list
with one entry per rank; a resume on another N takes rank r's entry, or rank 0's for a new rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .batches import Batch
from .checkpoint import capture, load_resume, restore
from .epochs import EpochLoader
from .errors import UserError
from .launcher import check_batch_split, launched_by_torchrun
from .parts import Stateful
from .sealed import save_sealed

# Parts whose state may differ between ranks, so each rank's is kept.
PER_RANK_PARTS = ("gen_state", "rng")
PER_RANK_KEY = "per_rank"


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes (rank 0 of 1 when alone)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "World":
        """The world torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK, or one process."""
        if not launched_by_torchrun():
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes files."""
        return self.rank == 0

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order, on every rank (picklable values)."""
        if self.size == 1:
            return [value]
        values: list = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (a preemption signal one rank saw)."""
        if self.size == 1:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def parts(self, parts: Mapping[str, Stateful]) -> dict[str, Stateful]:
        """`parts` with the per-rank ones wrapped so a resume file keeps every rank's state."""
        return {name: PerRank(part, self) if name in PER_RANK_PARTS else part for name, part in parts.items()}

    def replicate(self, run) -> None:
        """Make `run` this rank's replica: its slice of each global batch, and DDP (size > 1)."""
        check_batch_split(run.config.batch, self.size, run.config.grad_accum)
        if self.size == 1:
            return
        if run.device.type != "cpu":
            raise UserError(f"--device {run.device.type} with --nproc {self.size}: many processes run on the CPU (gloo) only")
        remainder = len(run.batches.dataset) % run.batches.batch if isinstance(run.batches, EpochLoader) else 0
        if remainder % self.size:
            raise UserError(f"--loader epoch: each epoch ends with a batch of {remainder} sequences, not divisible by "
                            f"{self.size} processes; choose another --batch")
        run.replicas = Replicas(run.model, self)


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, nccl for CUDA tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(world: World, device: torch.device = torch.device("cpu")) -> Iterator[World]:
    """Join the run's process group for the duration (nothing to join for one process)."""
    if world.size == 1:
        yield world
        return
    dist.init_process_group(backend_for(device))
    try:
        yield world
    finally:
        dist.destroy_process_group()


class PerRank:
    """A part saved as the list of every rank's state, and restored from this rank's entry.

    One process saves its plain state, so single-process resume files keep their layout. On resume
    with a different N, rank r takes saved rank r's state, or rank 0's when the run had fewer ranks:
    the batch generator is the same on every rank, so the samples stay exact; the RNG streams of
    ranks that did not exist start as rank 0's (they only matter for random draws such as dropout).
    """

    def __init__(self, part: Stateful, world: World):
        self.part, self.world = part, world

    def state_dict(self) -> Any:
        states = self.world.gather(self.part.state_dict())
        return states[0] if len(states) == 1 else {PER_RANK_KEY: states}

    def load_state_dict(self, state: Any) -> None:
        states = saved_states(state)
        self.part.load_state_dict(states[self.world.rank] if self.world.rank < len(states) else states[0])


def saved_states(state: Any) -> list:
    """The per-rank states a part was saved with (one entry for a single-process file)."""
    return state[PER_RANK_KEY] if isinstance(state, dict) and PER_RANK_KEY in state else [state]


def saved_world_size(state: Mapping) -> int:
    """How many processes wrote a resume state."""
    return len(saved_states(state["rng"]))


class _LossOf(torch.nn.Module):
    """The model's loss as a forward(), so DDP sees the call it must hook."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets)


class Replicas:
    """The run's model under DistributedDataParallel: this rank's slice of a batch, its loss, means over ranks."""

    def __init__(self, model: torch.nn.Module, world: World):
        self.rank, self.size = world.rank, world.size
        # find_unused_parameters keeps the gradient buckets as built here: otherwise DDP rebuilds them
        # after the first step, so the first step after a resume would sum gradients in another layout
        # than the uninterrupted run does (on 3+ ranks, gloo's ring then adds in another order).
        # The only buffers are the RoPE tables, derived from the config on every rank: nothing to sync.
        self.module = DistributedDataParallel(_LossOf(model), find_unused_parameters=True, forward_sync_buffers=False)

    def local(self, batch: Batch) -> Batch:
        """This rank's contiguous slice of the global batch (`replicate` checked that slices are equal).

        Every rank builds the whole global batch and keeps its slice: the samples of a step are then
        the same for any N, with either loader. The cost is each rank gathering N times the windows
        it trains on, small next to the forward and backward.
        """
        return Batch(*(rows.tensor_split(self.size)[self.rank] for rows in (batch.starts, batch.inputs, batch.targets)))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's loss; its backward all-reduces the gradients (their mean over ranks)."""
        return self.module(inputs, targets)

    def mean(self, value: float) -> float:
        """The mean of `value` over ranks (the global batch's loss, since each rank has an equal slice)."""
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)  # gloo has no AVG
        return total.item() / self.size


def is_sharded_folder(path: Path) -> bool:
    """A folder holding DCP's files (its index, shards or our commit marker): a --sharded checkpoint."""
    path = Path(path)
    return path.is_dir() and ((path / ".metadata").exists() or any(path.glob("*.distcp")) or (path / "commit.pth").exists())


def save_checkpoint(path: Path, parts: Mapping[str, Stateful], world: World, sharded: bool) -> None:
    """Every rank calls this: a sealed resume file written by rank 0, or a DCP folder of every rank's shard."""
    if sharded:
        from .sharded import save_sharded  # DCP takes a second to import: only when used

        save_sharded(Path(path), parts, world)
        return
    state = capture(parts)  # the per-rank parts gather every rank's state here
    if world.is_main:
        save_sealed(Path(path), state)
    world.barrier()


def restore_checkpoint(path: Path, parts: Mapping[str, Stateful], skip: Collection[str], world: World,
                       log=print) -> dict:
    """Verify and load a resume file or sharded folder into `parts` (all but `skip`); returns the state."""
    path = Path(path)
    if path.is_dir():
        from .sharded import load_sharded, sharded_parts

        state, parts = load_sharded(path), sharded_parts(parts)
    else:
        state = load_resume(path)
    restore(state, parts, skip=skip)
    saved = saved_world_size(state)
    if saved != world.size and world.is_main:
        log(f"resuming a {saved}-process run on {world.size}: the same samples; "
            "weights equal up to the order of floating-point reduction")
    return state
