"""What every store of numbered checkpoints shares, on a disk (folder.py) or an object store (s3/folder.py).

A checkpoint is named `step-00000030.pth` after its step (zero-padded, so names sort like steps); a
store saves the snapshot of its parts through its own `commit` stages, and loads its newest valid
checkpoint through its own `load_newest`. This module holds the names, the step check, and the
`save` / `load` both kinds of store offer, so that a caller never asks which kind it has.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exactresume.errors import CheckpointError, StorageError
from exactresume.store.locations import Location
from exactresume.store.resume import (
    STEP_KEY,
    capture,
    check_parts,
    check_resume_state,
    check_step,
    restore,
    started_fresh,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.pth$")
UNREADABLE_SUFFIX = ".unreadable"  # a file set aside rather than written over (folder.py)


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step`: zero-padded so names sort like steps."""
    return f"step-{step:08d}.pth"


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


def check_checkpoint(checkpoint: Checkpoint, state: Any) -> dict:
    """`state` as a store checkpoint of `checkpoint.step`, else CheckpointError."""
    state = check_resume_state(checkpoint.path, state)
    if state.get(STEP_KEY) != checkpoint.step:
        raise CheckpointError(f"{checkpoint.path}: holds step {state.get(STEP_KEY)}, not the step its name says")
    return state


class NumberedStore:
    """`save` and `load` over a store's own stages (`commit`, `remove_leftovers`, `load_newest`).

    A checkpoint that `load` found but could not load into the parts given (their names or tensors
    differ) is never written over or deleted by this store: every `save` refuses until a `load`
    succeeds (with `skip=` / `fresh=`) or the file is moved away. Nor does a save at a step that a
    verified checkpoint of the folder has reached, unless this store loaded or wrote it: a loop that
    forgot to load cannot write over its own run.
    """

    folder: Location
    keep: int | None
    refused: Checkpoint | None = None  # the checkpoint the last load could not load
    known: int | None = None  # the step this store last loaded or saved: the run it writes has reached it
    passed_over: frozenset = frozenset()  # what its last load skipped: never deleted by its retention
    blocked: Checkpoint | None = None  # a checkpoint a save was refused for: every later save is refused

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Location:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones."""
        step = self.check_save(step)
        try:
            self.faults.reached("snapshot")
            path = self.commit(step, snapshot(step, parts))
        except OSError as error:
            raise self.storage_error(step, error) from error
        self.known = step
        return path

    def storage_error(self, step: int, error: OSError) -> StorageError:
        """The one line for a save that the storage refused: what failed, why, and what is intact."""
        existing = self.checkpoints()
        intact = f"{existing[-1].path} is intact" if existing else "no earlier checkpoint exists"
        return StorageError.from_os_error(f"the checkpoint at step {step} in {self.folder}", error, f"; {intact}")

    def check_save(self, step: Any) -> int:
        """The step to save at, or a one-line error when this store must not save (see the class)."""
        step = check_step(step)
        if self.refused is not None and self.refused.path in [c.path for c in self.checkpoints()]:
            raise CheckpointError(
                f"{self.refused.path} could not be loaded into the parts given, so this store saves nothing "
                "that could write over or delete it: load it as the load's error says (skip=, fresh=, or the "
                "parts it was saved from), or move it out of the folder"
            )
        ahead = self.blocked or self.unknown_from(step)
        if ahead is not None:
            self.blocked = ahead  # a loop that catches this and goes on must not prune the run later
            raise CheckpointError(
                f"{self.folder} already holds {ahead.path.name}, a checkpoint this store has not loaded: load "
                "the folder first (store.load(parts)), or save into another folder"
            )
        return step

    def continue_from(self, step: int) -> None:
        """The run this store writes was resumed at `step` from elsewhere: its checkpoints up to there are its own."""
        self.known = step

    def unknown_from(self, step: int) -> Checkpoint | None:
        """A checkpoint at `step` or later, past what this store loaded or wrote, whose bytes verify: a save
        at `step` would write over it, or continue another run beside it."""
        for checkpoint in self.checkpoints():
            beyond = checkpoint.step >= step and (self.known is None or checkpoint.step > self.known)
            if beyond and checkpoint.path not in self.passed_over and self.verifies(checkpoint):
                return checkpoint
        return None

    def wait(self) -> None:
        """Nothing to wait for: `save` returns once the checkpoint is durable (the Saver interface)."""

    def _retain(self, step: int) -> None:
        """Delete all but the newest `keep` checkpoints up to `step` (`_delete`); a failure here only warns."""
        if self.keep is None:
            return
        kept = [c for c in self.checkpoints() if c.step <= step and c.path not in self.passed_over]
        older = kept[: -self.keep]
        try:
            self.faults.reached("retention")
            self._delete(older)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {self.folder}: {error.strerror or error}")

    def __enter__(self) -> NumberedStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(
        self,
        parts: Mapping[str, Stateful],
        skip: Collection[str] = (),
        fresh: Collection[str] = (),
        clean: bool = True,
    ) -> int | None:
        """Load the newest checkpoint that verifies into `parts`, all or nothing: its step, or None when there is none.

        Damaged checkpoints are skipped (each named to `notify`). When the parts given differ from the
        checkpoint's, this raises a CheckpointError naming both sides, loads nothing and falls back to
        no older file: `skip` names parts (given or saved) to leave as they are, `fresh` parts new
        since the save, which then start as they are. With `clean` (the writer) it first locks the
        folder and removes the leftovers of interrupted saves; without (a reader, such as another rank
        of a run whose rank 0 writes) it takes no lock.
        """
        check_parts(parts)  # a mistake in the call is named before anything is read or cleaned
        if clean:
            self.remove_leftovers()
        found = self.load_newest()
        if found is None:
            return None
        checkpoint, state = found
        try:
            starting = restore(state, parts, skip=skip, fresh=fresh, source=checkpoint.path)
        except CheckpointError:
            self.refused = checkpoint
            raise
        self.refused, self.blocked, self.known = None, None, checkpoint.step
        for name in starting:
            self.notify(started_fresh(checkpoint.path, name))
        return checkpoint.step

    def skipped(self, checkpoint: Checkpoint, error: CheckpointError, damaged: bool) -> None:
        """Say that `checkpoint` was passed over on the way to an older one, and why; keep it from retention."""
        self.passed_over = self.passed_over | {checkpoint.path}
        self.notify(f"skipping {'damaged ' if damaged else ''}checkpoint {error}")


__all__ = [
    "CHECKPOINT_NAME",
    "Checkpoint",
    "NumberedStore",
    "check_checkpoint",
    "UNREADABLE_SUFFIX",
    "checkpoint_name",
    "snapshot",
]
