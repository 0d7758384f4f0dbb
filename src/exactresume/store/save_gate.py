"""Whether a store may save into its folder: what it knows of the folder's checkpoints, in one state.

A store writes a folder only as the run it writes has it, so that no save writes over, or prunes, a
checkpoint it has no right to. Three facts decide, and `check` is the one place that reads them:

- `ours_up_to`: the furthest step this store loaded or saved, or the step its run resumed at from
  elsewhere: the checkpoints up to there are its run's own, to write over or prune; a save at a step
  before one of them is refused, as a resume would take that one and never the save.
- `bar`: a checkpoint this store must not save beside, and the line every save says while it is in
  the folder: one a load could not load (the parts differ, another run's identity, every checkpoint
  damaged), or one ahead of what the store knows that a save met (a loop that forgot to load, or
  another run's; a loop that catches the error and goes on must not prune it later).
- `passed_over`: the checkpoints the last load skipped (damaged, of a format this release does not
  read, or another run's in a local tier): never pruned or written over (a save at such a step sets
  the old one aside), and no bar to a save, which writes beside them.
- `superseded`: the run's own checkpoints past the step all its ranks resumed at (a local tier one rank
  alone held): no bar either; its saves write over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from exactresume.errors import CheckpointError
from exactresume.store.locations import Checkpoint, Location


@dataclass(frozen=True)
class Bar:
    """A checkpoint that stops every save while it is in the folder, and the line those saves say."""

    checkpoint: Checkpoint
    line: str


@dataclass
class SaveGate:
    ours_up_to: int | None = None
    # The first step a store that never loaded saved: the older checkpoints of its folder are not its run's
    # (a loop that forgot to load), so retention keeps them. None: the run's history is the store's to prune.
    saved_from: int | None = None
    bar: Bar | None = None
    passed_over: frozenset[Location] = field(default_factory=frozenset)
    superseded: frozenset[Location] = field(default_factory=frozenset)

    def check(
        self, step: int, folder: Location, checkpoints: list[Checkpoint], verifies: Callable[[Checkpoint], bool]
    ) -> None:
        """CheckpointError (the bar's line) when a save at `step` must not run among `folder`'s `checkpoints`."""
        if self.bar is not None and self.bar.checkpoint.path in {checkpoint.path for checkpoint in checkpoints}:
            raise CheckpointError(self.bar.line)
        ahead = self._ahead(step, checkpoints, verifies)
        if ahead is not None:
            self.bar = Bar(ahead, _not_loaded(folder, ahead))
            raise CheckpointError(self.bar.line)
        later = self._later_of_ours(step, checkpoints, verifies)
        if later is not None:  # no bar: a save past it may run
            raise CheckpointError(_step_went_back(step, later))
        if self.ours_up_to is None and self.saved_from is None:  # the first save of a store that never loaded
            self.saved_from = step

    def _ahead(
        self, step: int, checkpoints: list[Checkpoint], verifies: Callable[[Checkpoint], bool]
    ) -> Checkpoint | None:
        """A checkpoint at `step` or later, past what this store loaded or wrote, whose bytes verify: a save
        at `step` would write over it, or continue another run beside it."""
        for checkpoint in checkpoints:
            beyond = checkpoint.step >= step and (self.ours_up_to is None or checkpoint.step > self.ours_up_to)
            passed = checkpoint.path in self.passed_over or checkpoint.path in self.superseded
            if beyond and not passed and verifies(checkpoint):
                return checkpoint
        return None

    def _later_of_ours(
        self, step: int, checkpoints: list[Checkpoint], verifies: Callable[[Checkpoint], bool]
    ) -> Checkpoint | None:
        """A checkpoint of the run this store loaded or wrote, at a step past `step`, whose bytes verify: a
        resume would take it and never this save (a loop whose step went back: the step `load` returned
        not kept, a counter reset), and retention, counting up to `step`, would never prune it."""
        for checkpoint in reversed(checkpoints):
            ours = self.ours_up_to is not None and step < checkpoint.step <= self.ours_up_to
            passed = checkpoint.path in self.passed_over or checkpoint.path in self.superseded
            if ours and not passed and verifies(checkpoint):
                return checkpoint
        return None

    def saved(self, step: int, path: Location) -> None:
        """A save at `step` is durable at `path`: a checkpoint of the run again, kept or pruned as any."""
        self.ours_up_to = step if self.ours_up_to is None else max(self.ours_up_to, step)
        self.passed_over = self.passed_over - {path}

    def loaded(self, step: int) -> None:
        """A load of the checkpoint at `step` succeeded: the run is this store's up to there, nothing bars it."""
        self.ours_up_to, self.bar, self.saved_from = step, None, None

    def resumed_at(self, step: int) -> None:
        """The run this store writes was resumed at `step` from elsewhere: its checkpoints up to there are its own."""
        self.ours_up_to, self.saved_from = step, None

    def refuse(self, checkpoint: Checkpoint, line: str) -> None:
        """Every save says `line` while `checkpoint` is in the folder."""
        self.bar = Bar(checkpoint, line)

    def pass_over(self, path: Location) -> None:
        self.passed_over = self.passed_over | {path}

    def supersede(self, path: Location) -> None:
        self.superseded = self.superseded | {path}

    def prunable(self, checkpoints: list[Checkpoint], step: int) -> list[Checkpoint]:
        """The checkpoints up to `step` that retention may count and delete (oldest first): none older than
        the first save of a store that never loaded."""
        first = self.saved_from if self.saved_from is not None else -1
        return [c for c in checkpoints if first <= c.step <= step and c.path not in self.passed_over]


def _not_loaded(folder: Location, ahead: Checkpoint) -> str:
    """The line for a checkpoint ahead, naming the folder that holds it (a store of two tiers has two)."""
    return (
        f"{ahead.path.parent} already holds {ahead.path.name}, a checkpoint this store has not loaded: load "
        "the folder first (store.load(parts); exactresume train: --resume auto), or save into another folder"
    )


def _step_went_back(step: int, later: Checkpoint) -> str:
    """The line for a save at a step before a checkpoint of the run's own."""
    return (
        f"{later.path.parent} holds {later.path.name}, a later step of this run than the {step} being saved: a "
        "resume would take it, not this save: a loop's step goes on from the one load returned (step = "
        "store.load(parts) or 0); to go back to an earlier checkpoint, move the later ones out of the folder"
    )
