"""The epoch loader (`--loader epoch`): shuffled epochs of fixed-length samples through a DataLoader.

The training stream is cut into `(len(tokens) - 1) // seq_len` samples of seq_len + 1 tokens
(sample i starts at token i * seq_len; neighbours share one token, so every token is a target
once). Each epoch visits every sample once, in the order `epoch_order(seed, epoch, count)`, in
batches of `batch`; the last batch of an epoch holds the remainder (`count % batch`), as
DataLoader's drop_last=False does. Which samples global step s trains on is therefore a pure
function of (seed, epoch, cursor) = (seed, s // steps_per_epoch, s % steps_per_epoch):
`step_indices`.

The loader's state (the `gen_state` part) is the epoch, its permutation seed and the cursor (the
batches of that epoch already trained). Restoring it builds the DataLoader to start at the
cursor: O(1) in the batches already trained, nothing fast-forwarded, no skipped sample loaded.
Worker processes only load; the order is decided in this process, so --workers never changes
the result.

An epoch of up to PERMUTATION_LIMIT samples is ordered by `torch.randperm` (one int64 per
sample). A larger one, say hundreds of millions of samples from a memory-mapped corpus larger than
RAM, is ordered by a keyed bijection (`core.permutation`) computed for each batch's positions only:
nothing the size of the epoch is ever built.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from exactresume.core.batches import Batch
from exactresume.core.permutation import permute, round_keys
from exactresume.errors import CheckpointError, UserError

STATE_VERSION = 1
PERMUTATION_LIMIT = 1 << 24  # samples per epoch up to which the order is torch.randperm's


def epoch_seed(seed: int, epoch: int) -> int:
    """The permutation seed of `epoch`: a stable 63-bit hash of (run seed, epoch)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EpochOrder:
    """The sample indices of one epoch in training order; `take(first, stop)` computes only those."""

    def __init__(self, seed: int, epoch: int, count: int):
        self.count = count
        permutation_seed = epoch_seed(seed, epoch)
        if count <= PERMUTATION_LIMIT:
            self.table = torch.randperm(count, generator=torch.Generator().manual_seed(permutation_seed))
        else:
            self.table, self.keys = None, round_keys(permutation_seed)

    def __len__(self) -> int:
        return self.count

    def take(self, first: int, stop: int) -> torch.Tensor:
        """The indices at positions first .. stop - 1 of the order (fewer past its end), (n,) int64."""
        if self.table is not None:
            return self.table[first:stop]
        positions = np.arange(first, min(stop, self.count), dtype=np.uint64)
        return torch.from_numpy(permute(positions, self.count, self.keys).astype(np.int64))


def epoch_order(seed: int, epoch: int, count: int) -> EpochOrder:
    """The sample indices of `epoch` in training order."""
    return EpochOrder(seed, epoch, count)


def steps_per_epoch(count: int, batch: int) -> int:
    return -(-count // batch)


def step_indices(seed: int, count: int, batch: int, step: int) -> torch.Tensor:
    """The sample indices 0-based global `step` trains on: (batch,), fewer in an epoch's last batch."""
    epoch, cursor = divmod(step, steps_per_epoch(count, batch))
    return epoch_order(seed, epoch, count).take(cursor * batch, (cursor + 1) * batch)


class TokenSamples(Dataset):
    """Sample i of the token stream, as (i, int64 tokens of shape (seq_len + 1,)).

    `tokens` is a numpy array (a memory map: only the sample's tokens are read) or a tensor.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        if isinstance(window, np.ndarray):
            window = torch.from_numpy(window.astype(np.int64))
        return index, window


class EpochBatches:
    """The batch sampler of one epoch from batch `cursor` on: lists of sample indices, made lazily."""

    def __init__(self, order: EpochOrder, batch: int, cursor: int):
        self.order, self.batch, self.cursor = order, batch, cursor

    def __iter__(self):
        for first in range(self.cursor * self.batch, len(self.order), self.batch):
            yield self.order.take(first, first + self.batch).tolist()

    def __len__(self) -> int:
        return steps_per_epoch(len(self.order), self.batch) - self.cursor


class EpochLoader:
    """Shuffled epochs through torch's DataLoader with `workers` processes; its state is the data position."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int, workers: int = 0):
        if len(tokens) < seq_len + 1:
            raise UserError(
                f"the corpus has {len(tokens)} training tokens, too few for --seq-len {seq_len} "
                f"(need at least {seq_len + 1})"
            )
        self.dataset = TokenSamples(tokens, seq_len)
        self.batch, self.seq_len, self.seed, self.workers = batch, seq_len, seed, workers
        self.epoch, self.cursor = 0, 0
        self._iterator = None  # the current epoch's DataLoader iterator, made when first needed

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.dataset), self.batch)

    def _epoch_iterator(self):
        order = epoch_order(self.seed, self.epoch, len(self.dataset))
        # The workers' base seed is drawn from this generator; without one, DataLoader would draw it
        # from the global torch RNG, which dropout owns, at moments a resumed run does not repeat.
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        loader = DataLoader(
            self.dataset,
            batch_sampler=EpochBatches(order, self.batch, self.cursor),
            num_workers=self.workers,
            generator=generator,
        )
        return iter(loader)

    def next_batch(self) -> Batch:
        if self._iterator is None:
            self._iterator = self._epoch_iterator()
        indices, rows = next(self._iterator)
        self.cursor += 1
        if self.cursor == self.steps_per_epoch:
            self.epoch, self.cursor, self._iterator = self.epoch + 1, 0, None
        return Batch(indices * self.seq_len, rows[:, :-1], rows[:, 1:])

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "permutation_seed": epoch_seed(self.seed, self.epoch),
            "cursor": self.cursor,
            "samples": len(self.dataset),
            "batch": self.batch,
        }

    def load_state_dict(self, state: dict) -> None:
        problem = self._state_problem(state)
        if problem:
            raise CheckpointError(f"the epoch loader state in the resume file {problem}")
        self.epoch, self.cursor, self._iterator = state["epoch"], state["cursor"], None

    def _state_problem(self, state: dict) -> str | None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            return f"is not an epoch loader state of version {STATE_VERSION}"
        if (state["samples"], state["batch"]) != (len(self.dataset), self.batch):
            return (
                f"is for {state['samples']} samples in batches of {state['batch']}; this run has "
                f"{len(self.dataset)} in batches of {self.batch}"
            )
        if state["permutation_seed"] != epoch_seed(self.seed, state["epoch"]):
            return f"has a permutation seed this run does not use for epoch {state['epoch']}"
        if not 0 <= state["cursor"] < self.steps_per_epoch:
            return f"has cursor {state['cursor']} outside the epoch's {self.steps_per_epoch} batches"
        return None
