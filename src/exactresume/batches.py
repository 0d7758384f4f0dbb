"""The batch sampler: random windows of the token stream, drawn from one torch.Generator.

The generator's state *is* the data position: saving `get_state()` and restoring it with
`set_state()` makes a resumed run draw exactly the batches the uninterrupted run would have
drawn, with no fast-forwarding and no batch seen twice.

Under many processes every rank draws the same global batch and trains on its own slice of it
(`shard`, `local`), so the sequence of samples does not depend on the number of processes.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import UserError


class RandomWindows:
    """Draws (inputs, targets) of shape (batch, seq_len) from random offsets of `tokens`."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise UserError(f"the corpus has {len(tokens)} training tokens, too few for --seq-len {seq_len} (need at least {seq_len + 2})")
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.batch, self.seq_len = batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self._window = torch.arange(seq_len + 1)
        self.rank, self.ranks = 0, 1

    def shard(self, rank: int, ranks: int) -> None:
        """Train on slice `rank` of `ranks` equal slices of each global batch."""
        if self.batch % ranks:
            raise UserError(f"--batch {self.batch} is not divisible by {ranks} processes; the global batch is split evenly")
        self.rank, self.ranks = rank, ranks

    def local(self, starts: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global batch's window offsets."""
        return starts.view(self.ranks, -1)[self.rank]

    def draw_starts(self) -> torch.Tensor:
        """The next batch's window offsets (batch,), advancing the generator."""
        return torch.randint(0, len(self.tokens) - self.seq_len, (self.batch,), generator=self.generator)

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token windows at `starts` as (inputs, targets), each (batch, seq_len)."""
        rows = self.tokens[starts[:, None] + self._window]
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
