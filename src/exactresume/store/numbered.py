"""What every store of numbered checkpoints shares, on a disk (folder.py) or an object store (s3/folder.py).

A checkpoint is named `step-00000030.pth` after its step (zero-padded, so names sort like steps); a
store saves the snapshot of its parts through its own `commit` stages, and loads its newest valid
checkpoint through its own `load_newest`. This module holds the names, the step check, and the
`save` / `load` both kinds of store offer, so that a caller never asks which kind it has.

`save` is the one way a run saves its checkpoints, whatever the store's options: synchronous or in
the background (`background=True`: background.py), one process or many (`world=`: every rank calls
`save` and `load`, the per-rank parts keep every rank's state, rank 0 writes), on a disk or under
an `s3://` prefix. A store given `identity=` saves it with each checkpoint and loads none of another
run (identity.py).

`load` never starts a run fresh over checkpoints it could not load: a folder whose every checkpoint
is damaged is refused, naming them, rather than read as empty.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exactresume.errors import CheckpointError, FieldError, StorageError, UserError
from exactresume.store.background import BEFORE_RETURN, BackgroundWriter
from exactresume.store.identity import check_identity, refuse_another_run
from exactresume.store.locations import Checkpoint, Location
from exactresume.store.resume import (
    STEP_KEY,
    capture,
    check_parts,
    check_resume_state,
    check_step,
    for_one_file,
    per_rank,
    restore,
    started_fresh,
)
from exactresume.store.save_gate import SaveGate
from exactresume.world import World, given_world, launched_by_torchrun

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.pth$")
UNREADABLE_SUFFIX = ".unreadable"  # a file set aside rather than written over (folder.py)
NAMED = 3  # checkpoints a refusal names before "and N more"


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step`: zero-padded so names sort like steps."""
    return f"step-{step:08d}.pth"


def snapshot(step: int, parts: Mapping[str, Stateful], identity: dict | None = None) -> dict:
    """The state to write: every part's state_dict, the step, and the run's identity when it has one.

    The tensors are references to the live ones, not copies: fine while `save` runs before the next
    step; a writer in the background works on a copy (background.py).
    """
    return capture(parts, step, identity)


def check_checkpoint(checkpoint: Checkpoint, state: Any) -> dict:
    """`state` as a store checkpoint of `checkpoint.step`, else CheckpointError."""
    state = check_resume_state(checkpoint.path, state)
    if state.get(STEP_KEY) != checkpoint.step:
        raise CheckpointError(f"{checkpoint.path}: holds step {state.get(STEP_KEY)}, not the step its name says")
    return state


class NumberedStore:
    """`save` and `load` over a store's own stages (`commit`, `remove_leftovers`, `load_newest`).

    A checkpoint that `load` found but could not load (the parts given differ, it is another run's, or
    every checkpoint of the folder is damaged) is never written over or deleted by this store: every
    `save` refuses until a `load` succeeds (with `skip=` / `fresh=` / `any_identity=`) or the file is
    moved away. Nor does a save at a step that a verified checkpoint of the folder has reached, unless
    this store loaded or wrote it: a loop that forgot to load cannot write over its own run. The
    store's `gate` (save_gate.py) holds what decides, and decides.
    """

    folder: Location
    keep: int | None
    identity: dict | None = None  # the run's, saved with each checkpoint and checked by `load` (identity.py)
    gate: SaveGate  # whether a save may run (save_gate.py): set by `_set_saving`
    held_skips: list[Skipped] | None = None  # what `load_newest` passed over, not said yet

    world: World = World()
    writer: BackgroundWriter | None = None  # with background=True, on the rank that writes
    coalesced: int = 0  # saves skipped by `coalesce` because the one before was still being written

    def _set_saving(
        self, background: bool, copy: str | None, world: World | None, identity: dict | None = None
    ) -> None:
        """The options every store takes: saves in the background (copying as `copy` says), the processes
        that save together (`world`; rank 0 writes), and the run's `identity` (identity.py)."""
        self.identity, self.gate = check_identity(identity), SaveGate()
        if not isinstance(background, bool):
            raise FieldError(f"background must be True or False, got {background!r}", "background")
        if copy is not None and not background:
            raise FieldError("copy= says how a background save copies the state: give background=True with it", "copy")
        self.world = given_world(world, World())
        if background and self.world.is_main:
            self.writer = BackgroundWriter(self, copy or BEFORE_RETURN)

    def save(self, step: int, parts: Mapping[str, Stateful], coalesce: bool = False) -> Location | None:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones; where it is.

        In the background, it returns once the state is copied (or at once: background.py), and with
        `coalesce` a save asked for while the one before is still being written is skipped (None).
        Under many processes every rank calls it, and every rank skips together."""
        check_parts(parts)
        parts = for_one_file(parts, self.world, "CheckpointStore(folder, sharded=True, world=World.from_env())")
        if self.skips(coalesce):
            return None
        if not self.world.is_main:
            capture(parts, step)  # takes part in gathering the per-rank parts; rank 0 writes
            path = self.path_for(check_step(step))
        elif self.writer is not None:
            path = self.writer.save(step, parts)
        else:
            path = self._save_now(step, parts)
        self.world.barrier()
        return path

    def skips(self, coalesce: bool) -> bool:
        """With `coalesce`, whether a save asked for now is skipped (and counted in `coalesced`) because
        the one before is still being written; under many processes every rank answers the same."""
        if coalesce and self.world.any(self.busy()):
            self.coalesced += 1
            return True
        return False

    def _save_now(self, step: int, parts: Mapping[str, Stateful]) -> Location:
        step = self.check_save(step)
        try:
            self.faults.reached("snapshot")
            path = self.commit(step, snapshot(step, parts, self.identity))
        except OSError as error:
            raise self.storage_error(step, error) from error
        self.reached(step)
        return path

    def busy(self) -> bool:
        """Whether a background save is still being copied or written."""
        return self.writer is not None and self.writer.busy()

    def wait(self) -> None:
        """Block until the last save is durable, or raise its error (a synchronous save already is)."""
        if self.writer is not None:
            self.writer.wait()

    def wait_for_copy(self) -> None:
        """Block until a background save has copied the state (copy="during-next-step"): from then on
        the state may change. Raises that save's CheckpointError if the state changed before."""
        if self.writer is not None:
            self.writer.wait_for_copy()

    @property
    def blocked_seconds(self) -> float:
        """The time `save` and the optimizer's step waited for background saves."""
        return self.writer.blocked_seconds if self.writer is not None else 0.0

    def close(self) -> None:
        """Wait for the save in flight, then let another store write the folder (`release`)."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the folder's lock (or the prefix's lease)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _one_writer(self) -> Iterator[None]:
        """The folder's lock (or the prefix's lease) taken inside: when another holds it and this is one
        rank of a torchrun job whose store was given no world, the refusal names the likely cause."""
        try:
            yield
        except UserError as refused:
            if self.world.size > 1 or not launched_by_torchrun():
                raise
            hint = "under torchrun, give every rank's store world=World.from_env(), and rank 0 writes"
            raise UserError(f"{refused}; {hint}") from None

    def storage_error(self, step: int, error: OSError) -> StorageError:
        """The one line for a save that the storage refused: what failed, why, and what is intact (where the
        folder can still be listed); its cause is `error`."""
        try:
            existing = self.checkpoints()
            intact = f"; {existing[-1].path} is intact" if existing else "; no earlier checkpoint exists"
        except OSError:
            intact = ""
        refused = StorageError.from_os_error(f"the checkpoint at step {step} in {self.folder}", error, intact)
        refused.__cause__ = error
        return refused

    def check_save(self, step: Any) -> int:
        """The step to save at, or a one-line error when this store must not save (save_gate.py)."""
        step = check_step(step)
        self.gate.check(step, self.folder, self.checkpoints(), self.verifies)
        return step

    def reached(self, step: int) -> None:
        """A save at `step` is durable."""
        self.gate.saved(step, self.path_for(step))

    def continue_from(self, step: int) -> None:
        """The run this store writes was resumed at `step` from elsewhere: its checkpoints up to there are its own."""
        self.gate.resumed_at(step)

    def _retain(self, step: int) -> None:
        """Delete all but the newest `keep` checkpoints up to `step` (`_delete`); a failure here only warns."""
        if self.keep is None:
            return
        older = self.gate.prunable(self.checkpoints(), step)[: -self.keep]
        try:
            self.faults.reached("retention")
            self._delete(older)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {self.folder}: {error.strerror or error}")

    def __enter__(self) -> NumberedStore:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> None:
        try:
            self.close()
        except Exception:
            if error is None:
                raise
            # else the error in flight is the one raised, not a background save's

    def load(
        self,
        parts: Mapping[str, Stateful],
        skip: Collection[str] = (),
        fresh: Collection[str] = (),
        clean: bool = True,
        any_identity: bool = False,
    ) -> int | None:
        """Load the newest checkpoint that verifies into `parts`, all or nothing: its step, or None when there is none.

        Damaged checkpoints are skipped (each named to `notify`); when every one is, this raises a
        CheckpointError naming them rather than give None, on which a loop would start fresh over them.
        When the parts given differ from the checkpoint's, or it was saved by a run of another identity
        than the store's (unless `any_identity`), this raises a CheckpointError naming both sides, loads
        nothing and falls back to no older file: `skip` names parts (given or saved) to leave as they
        are, `fresh` parts new since the save, which then start as they are. With `clean` (the writer)
        it first locks the folder and removes the leftovers of interrupted saves; without (a reader) it
        takes no lock. Under many processes every rank calls it, each restores its own entry of the
        per-rank parts, and only rank 0 cleans.
        """
        check_parts(parts)  # a mistake in the call is named before anything is read or cleaned
        parts = per_rank(parts, self.world)
        if clean and self.world.is_main:
            self.remove_leftovers()
        found = self.newest_loadable()
        if found is None:
            return None
        checkpoint, state = found
        if not any_identity:
            self._check_run(checkpoint, state)
        try:
            starting = restore(state, parts, skip=skip, fresh=fresh, source=checkpoint.path)
        except CheckpointError:
            self.gate.refuse(checkpoint, _misfit_saves(checkpoint))
            raise
        self.gate.loaded(checkpoint.step)
        for name in starting:
            self.notify(started_fresh(checkpoint.path, name))
        return checkpoint.step

    def newest_loadable(self) -> tuple[Checkpoint, dict] | None:
        """`load_newest`, but a folder whose every checkpoint it passes over is refused (CheckpointError
        naming them), not taken for an empty one: None only when there is no checkpoint at all. Each
        checkpoint passed over on the way to an older one is named to `notify`."""
        self.held_skips = []
        try:
            found = self.load_newest()
        finally:
            held, self.held_skips = self.held_skips, None
        if found is None and held:
            self.gate.refuse(held[0].checkpoint, _damaged_saves(self.folder))
            raise _none_loadable(self.folder, held)
        for skipped in held:
            self.notify(skipped.line())
        return found

    def _check_run(self, checkpoint: Checkpoint, state: dict) -> None:
        """CheckpointError when `checkpoint` is not this store's run by its identity; saves refuse then."""
        try:
            refuse_another_run(state, self.identity, checkpoint.path, ANOTHER_RUN_WAY_OUT)
        except CheckpointError:
            self.gate.refuse(checkpoint, _another_run_saves(checkpoint))
            raise

    def skipped(self, checkpoint: Checkpoint, error: CheckpointError, damaged: bool) -> None:
        """Say that `checkpoint` was passed over on the way to an older one, and why; keep it from retention.
        Inside `newest_loadable` it is said only once an older one is found."""
        self.gate.pass_over(checkpoint.path)
        if self.held_skips is not None:
            self.held_skips.append(Skipped(checkpoint, error, damaged))
        else:
            self.notify(Skipped(checkpoint, error, damaged).line())


@dataclass(frozen=True)
class Skipped:
    """A checkpoint a load passed over, and why: its bytes do not verify (`damaged`), or it is not one
    this release reads."""

    checkpoint: Checkpoint
    error: CheckpointError
    damaged: bool

    def line(self) -> str:
        return f"skipping {'damaged ' if self.damaged else ''}checkpoint {self.error}"


ANOTHER_RUN_WAY_OUT = (
    "call store.load(parts, any_identity=True) (later saves record the store's identity), or use another folder"
)


def _another_run_saves(checkpoint: Checkpoint) -> str:
    return (
        f"{checkpoint.path} is not known to be this store's run (its identity), so this store saves nothing that "
        "could write over or delete it: load it with store.load(parts, any_identity=True), or use another folder"
    )


def _misfit_saves(checkpoint: Checkpoint) -> str:
    return (
        f"{checkpoint.path} could not be loaded into the parts given, so this store saves nothing "
        "that could write over or delete it: load it as the load's error says (skip=, fresh=, or the "
        "parts it was saved from), or move it out of the folder"
    )


def _damaged_saves(folder: Location) -> str:
    return (
        f"no checkpoint of {folder} could be loaded, so this store saves nothing beside them: move them out "
        "of the folder to start fresh, or use another folder"
    )


def _none_loadable(folder: Location, passed: list[Skipped]) -> CheckpointError:
    """The one line for a folder none of whose checkpoints loads (`passed`, newest first): a run started
    fresh there would train, and save, over them."""
    names = [skipped.checkpoint.path.name for skipped in passed]
    newest = passed[0]
    reason = str(newest.error).removeprefix(f"{newest.checkpoint.path}: ")  # the line names the folder once
    if len(names) == 1:
        what = f"the only checkpoint in {folder} cannot be loaded ({names[0]}: {reason})"
    else:
        more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
        listed = ", ".join(names[:NAMED]) + more
        what = f"none of the {len(names)} checkpoints in {folder} can be loaded ({listed}; the newest: {reason})"
    return CheckpointError(
        f"{what}; nothing was loaded, rather than start fresh over {'it' if len(names) == 1 else 'them'}: to start "
        "fresh on purpose, move the checkpoints out of the folder (or delete them), or use another folder"
    )


__all__ = [
    "CHECKPOINT_NAME",
    "NumberedStore",
    "check_checkpoint",
    "UNREADABLE_SUFFIX",
    "checkpoint_name",
    "snapshot",
]
