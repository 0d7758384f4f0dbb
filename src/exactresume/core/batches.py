"""The batch sampler: random windows of the token stream, drawn from one torch.Generator.

The generator's state *is* the data position: saving `get_state()` and restoring it with
`set_state()` makes a resumed run draw exactly the batches the uninterrupted run would have
drawn, with no fast-forwarding and no batch seen twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from exactresume.errors import UserError


@dataclass(frozen=True)
class Batch:
    """One optimizer step's sequences, from either loader.

    `starts` names each sequence by the offset of its first token in the training stream (B,),
    so the samples logs of both loaders read the same; inputs and targets are (B, T).
    """

    starts: torch.Tensor
    inputs: torch.Tensor
    targets: torch.Tensor


class RandomWindows:
    """Draws (inputs, targets) of shape (batch, seq_len) from random offsets of `tokens`."""

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise UserError(
                f"the corpus has {len(tokens)} training tokens, too few for --seq-len {seq_len} "
                f"(need at least {seq_len + 2})"
            )
        self.tokens = tokens  # a numpy array, usually a memory map: windows are read when drawn
        self.batch, self.seq_len = batch, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self._window = np.arange(seq_len + 1)

    def draw_starts(self) -> torch.Tensor:
        """The next batch's window offsets (batch,), advancing the generator."""
        return torch.randint(0, len(self.tokens) - self.seq_len, (self.batch,), generator=self.generator)

    def windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token windows at `starts` as (inputs, targets), each (batch, seq_len)."""
        rows = torch.from_numpy(self.tokens[starts.numpy()[:, None] + self._window].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def next_batch(self) -> Batch:
        starts = self.draw_starts()
        return Batch(starts, *self.windows(starts))

    def state_dict(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def micro_batches(batch: Batch, rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
    """(inputs, targets, share) of at most `rows` sequences each; the shares of one batch sum to 1."""
    total = len(batch.starts)
    for inputs, targets in zip(batch.inputs.split(rows), batch.targets.split(rows)):
        yield inputs, targets, len(inputs) / total
