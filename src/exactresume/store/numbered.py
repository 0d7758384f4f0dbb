"""What every store of numbered checkpoints shares, on a disk (folder.py) or an object store (s3_folder.py).

A checkpoint is named `step-00000030.pth` after its step (zero-padded, so names sort like steps); a
store saves the snapshot of its parts through its own `commit` stages, and loads its newest valid
checkpoint through its own `load_newest`. This module holds the names, the step check, and the
`save` / `load` both kinds of store offer, so that a caller never asks which kind it has.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exactresume.errors import CheckpointError
from exactresume.store.locations import Location
from exactresume.store.resume import STEP_KEY, capture, check_resume_state, restore

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.pth$")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step`: zero-padded so names sort like steps."""
    return f"step-{step:08d}.pth"


def print_to_stderr(message: str) -> None:
    print(f"exactresume: {message}", file=sys.stderr)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a store (a file, or an object) and the step its name says it holds."""

    step: int
    path: Location


def snapshot(step: int, parts: Mapping[str, Stateful]) -> dict:
    """The state to write: every part's state_dict and the step.

    The tensors are references to the live ones, not copies: fine while `save` runs before the next
    step; a writer in the background works on a copy (background.py).
    """
    return capture(parts, step)


def check_checkpoint(checkpoint: Checkpoint, state: Any, names: Collection[str]) -> dict:
    """`state` as a store checkpoint of `checkpoint.step` holding `names`, else CheckpointError."""
    state = check_resume_state(checkpoint.path, state, names)
    if state.get(STEP_KEY) != checkpoint.step:
        raise CheckpointError(f"{checkpoint.path}: holds step {state.get(STEP_KEY)}, not the step its name says")
    return state


class NumberedStore:
    """`save` and `load` over a store's own stages (`commit`, `remove_leftovers`, `load_newest`)."""

    folder: Location
    keep: int | None

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Location:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones."""
        self.faults.reached("snapshot")
        return self.commit(step, snapshot(step, parts))

    def wait(self) -> None:
        """Nothing to wait for: `save` returns once the checkpoint is durable (the Saver interface)."""

    def _retain(self, step: int) -> None:
        """Delete all but the newest `keep` checkpoints up to `step` (`_delete`); a failure here only warns."""
        if self.keep is None:
            return
        older = [c for c in self.checkpoints() if c.step <= step][: -self.keep]
        try:
            self.faults.reached("retention")
            self._delete(older)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {self.folder}: {error.strerror or error}")

    def __enter__(self) -> NumberedStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, parts: Mapping[str, Stateful], skip: Collection[str] = (), clean: bool = True) -> int | None:
        """Load the newest valid checkpoint into `parts` (except `skip`): its step, or None when there is none.

        With `clean` (the writer) it first locks the folder and removes the leftovers of interrupted
        saves; without (a reader, such as another rank of a run whose rank 0 writes) it takes no lock.

        A run's identity mismatch (a `RunIdentity` part) raises CheckpointError rather than falling
        back to an older file: an older file of a different run is no better.
        """
        if clean:
            self.remove_leftovers()
        found = self.load_newest([name for name in parts if name not in skip])
        if found is None:
            return None
        checkpoint, state = found
        restore(state, parts, skip=skip)
        return checkpoint.step


__all__ = ["CHECKPOINT_NAME", "Checkpoint", "NumberedStore", "check_checkpoint", "checkpoint_name", "snapshot"]
