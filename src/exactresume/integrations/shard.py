"""Accelerate's DataLoaderShard, read through a ResumableLoader: what the Trainer and an Accelerate loop iterate.

`accelerator.prepare(loader)` gives a DataLoaderShard around a DataLoader of its own making, which it
reads one batch ahead of the loop (to know the last batch before the loop takes it). The shard stays
as it is, and the DataLoader under it is read through a ResumableLoader, so at a resume it opens where
the loop stopped, reading none of the batches before.
"""

from __future__ import annotations

import torch

from exactresume.errors import UserError, a_kind_of
from exactresume.loaders.resumable import ResumableLoader

from .loop_state import LoopState
from .read_through import ReadThrough


def state_file(rank: int, loader: int = 0) -> str:
    """The file beside the framework's own in a checkpoint folder: each rank's, and each loader's after the first."""
    return f"exactresume-rank{rank}.pt" if loader == 0 else f"exactresume-rank{rank}-loader{loader}.pt"


def read_through(shard) -> LoopState:
    """Read `shard`'s DataLoader through a ResumableLoader; a UserError where it cannot be."""
    base = getattr(shard, "base_dataloader", None)
    if isinstance(base, ReadThrough):
        raise UserError("it is given this loader twice; the first call acts and this one does nothing")
    if base is None or not isinstance(base, torch.utils.data.DataLoader):
        raise UserError(f"it takes what accelerator.prepare(loader) returns, got {a_kind_of(shard)}")
    if getattr(shard, "use_stateful_dataloader", False):
        raise UserError("use_stateful_dataloader=True has Accelerate restore the loader itself")
    if getattr(shard, "skip_batches", 0):
        raise UserError("the loader skips batches itself (skip_first_batches); give it the loader prepare returned")
    _make_seedable_generator(base)
    state = LoopState(ResumableLoader(base))
    shard.base_dataloader = ReadThrough(state)
    return state


def _make_seedable_generator(loader) -> None:
    """Accelerate's SeedableRandomSampler (the Trainer's, and `use_seedable_sampler=True`'s) makes its
    generator at its first iteration and seeds it anew at each from its epoch: made now, it is one of the
    loader's generators from the start, and the order is the same."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    if type(sampler).__name__ == "SeedableRandomSampler" and getattr(sampler, "generator", 0) is None:
        sampler.generator = torch.Generator()


def stand_aside(shard, state: LoopState) -> None:
    """The shard reads its own DataLoader again, and `state`, which no longer follows it, is not saved."""
    shard.base_dataloader = state.loader.loader
    state.off = True


def taken(state: LoopState) -> int:
    """The batches of the current epoch the loop took from the shard: the ResumableLoader handed out one
    more, unless the epoch has ended under the shard."""
    loader = state.loader
    if loader.between_epochs:
        return loader.finished.consumed
    return max(loader.position.consumed - 1, 0)


def set_epoch(shard, state: LoopState) -> None:
    """The shard's epoch count, as the loaded position has it (the shard sets its sampler's epoch from it)."""
    shard.iteration = state.loader.epoch
