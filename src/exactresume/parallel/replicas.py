"""Many processes: one run as N replicas under torch.distributed (DistributedDataParallel).

    exactresume train ... --nproc 2                                # relaunches itself under torchrun
    torchrun --nproc-per-node 2 -m exactresume -- train ...   # or launch it yourself (multi-node too)

The global batch stays `--batch`: every rank draws the whole global batch of window starts from
the same generator state and trains on its own slice, so the samples seen are a function of the
seed and the global step, never of N. Gradients are averaged by DDP. Only rank 0 writes files.
What differs per rank (the batch generator, the RNGs) is gathered into the resume file as a list
with one entry per rank; a resume on another N takes rank r's entry, or rank 0's for a new rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from exactresume.config import TrainConfig
from exactresume.core.batches import Batch, micro_batches
from exactresume.parallel.exact import MicroStep
from exactresume.world import World


def _backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, nccl for CUDA tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


# Groups left by `process_group`, kept until the process ends. A DDP model built in the group
# outlives it (the run is returned), and its C++ reducer holds the group too: if the reducer dropped
# the last reference, gloo's backend would be destroyed with the interpreter lock held, joining
# gloo's worker thread while that thread waits for the lock to free a finished collective's tensor,
# and the rank would hang at the end of its run (pytorch #56297). Python's own reference is released
# without the lock, so it must be the last one.
_FINISHED_GROUPS: list[dist.ProcessGroup] = []


@contextlib.contextmanager
def process_group(world: World, device: torch.device = torch.device("cpu")) -> Iterator[World]:
    """Join the run's process group for the duration (nothing to join for one process)."""
    if world.size == 1:
        yield world
        return
    dist.init_process_group(_backend_for(device))
    _FINISHED_GROUPS.append(dist.group.WORLD)
    try:
        yield world
        # Tear down together: a rank that closes its gloo connections while a peer is still finishing
        # (rank 0 writing the final files) made that peer abort at exit now and then on 4 processes.
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _LossOf(torch.nn.Module):
    """The model's loss as a forward(), so DDP sees the call it must hook."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets)


class OneProcess:
    """The replica of a run on one process: the whole batch in `grad_accum` micro-batches, no reduction."""

    size = 1

    def __init__(self, model: torch.nn.Module):
        self.loss = model.loss

    def gradient(self, batch: Batch, config: TrainConfig, micro_step: MicroStep) -> float:
        """Accumulate the batch's gradient in .grad; return the batch's loss."""
        return accumulate(batch, config.batch // config.grad_accum, micro_step)


def accumulate(batch: Batch, rows: int, micro_step: MicroStep) -> float:
    """Every micro-batch of at most `rows` sequences stepped in order; the share-weighted sum of their losses."""
    loss = 0.0
    for index, (inputs, targets, share) in enumerate(micro_batches(batch, rows)):
        loss += micro_step(inputs, targets, share, index) * share
    return loss


class DataParallel:
    """What DDP's and FSDP2's replicas share: this rank's slice of a batch, averaged over ranks."""

    def __init__(self, world: World):
        self.rank, self.size = world.rank, world.size
        self.loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # set by the subclass

    def local(self, batch: Batch) -> Batch:
        """This rank's contiguous slice of the global batch (`replicate` checked that slices are equal).

        Every rank builds the whole global batch and keeps its slice: the samples of a step are then
        the same for any N, with either loader. The cost is each rank gathering N times the windows
        it trains on, small next to the forward and backward.
        """
        return Batch(*(rows.tensor_split(self.size)[self.rank] for rows in (batch.starts, batch.inputs, batch.targets)))

    def gradient(self, batch: Batch, config: TrainConfig, micro_step: MicroStep) -> float:
        """This rank's slice in `grad_accum` micro-batches, its gradient the mean over ranks; the batch's loss."""
        return self.mean(accumulate(self.local(batch), config.batch // self.size // config.grad_accum, micro_step))

    def mean(self, value: float) -> float:
        """The mean of `value` over ranks (the global batch's loss, since each rank has an equal slice)."""
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)  # gloo has no AVG
        return total.item() / self.size


class Replicas(DataParallel):
    """The run's model under DistributedDataParallel: a whole copy on every rank, gradients all-reduced."""

    def __init__(self, model: torch.nn.Module, world: World):
        super().__init__(world)
        # find_unused_parameters keeps the gradient buckets as built here: otherwise DDP rebuilds them
        # after the first step, so the first step after a resume would sum gradients in another layout
        # than the uninterrupted run does (on 3+ ranks, gloo's ring then adds in another order).
        # The only buffers are the RoPE tables, derived from the config on every rank: nothing to sync.
        self.module = DistributedDataParallel(_LossOf(model), find_unused_parameters=True, forward_sync_buffers=False)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's loss; its backward all-reduces the gradients (their mean over ranks)."""
        return self.module(inputs, targets)
