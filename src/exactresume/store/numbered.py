"""Numbered checkpoints that survive kill -9, full disks and damaged files: one store, one save path.

    store = CheckpointStore("runs/a/checkpoints", keep=3)
    step = store.load(parts)       # newest valid checkpoint into `parts`: its step, or None when there is none
    store.save(step, parts)        # FOLDER/step-00000030.pth, durable and verified; older ones pruned

A store is a location and a layout. The location is a folder on a disk (disk.py) or an `s3://` prefix
(s3/prefix.py); the layout is one sealed file per checkpoint, or with `sharded=True` a sharded folder
(`step-00000030.dcp`) of which every rank writes its shard (layout.py). The rest are options of the
one save: `background=True` saves in a writer thread (background.py), `world=` makes every rank of a
run call `save` and `load` (rank 0 writes a one-file checkpoint, holding every rank's per-rank
parts; each rank its shard of a sharded one), `identity=` saves the run's identity with each
checkpoint and loads none of another run (identity.py).

`parts` maps names to objects with `state_dict()` / `load_state_dict()` (a model, an optimizer, a
batch generator wrapper, `GlobalRng()`, ...). A checkpoint is a resume file (resume.py) plus the step
it was saved at: `torch.load(path, weights_only=True)` gives every part under its name. A save is

    gate (may it run?) -> snapshot -> write and verify (the location's stages) -> retention

so a kill at any moment leaves either no new checkpoint or a complete one, and older ones are deleted
only after the new one is durable and reads back verified. A model sharded over the ranks (FSDP2) is
saved as it is sharded and loaded back into however it is sharded then.

`load` walks from the newest checkpoint down, skips (and names) any that is damaged, and never starts
a run fresh over checkpoints it could not load: a folder whose every checkpoint is damaged is refused,
naming them. A checkpoint that `load` found but could not load is never written over or deleted by
this store (save_gate.py). One writer per location: the first save, or a load that cleans up, takes
the folder's lock or the prefix's lease until `close()` (or the end of a `with` block); a second
store writing the same place is refused naming the holder. Listing and `load_newest` take no lock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from exactresume.config import check_keep
from exactresume.errors import CheckpointError, FieldError, StorageError, UserError, notice
from exactresume.store.background import BEFORE_RETURN, BackgroundWriter
from exactresume.store.disk import DiskFolder
from exactresume.store.faults import FaultPoints
from exactresume.store.identity import check_identity, refuse_another_run
from exactresume.store.layout import ONE_FILE, SHARDED, Layout, check_checkpoint
from exactresume.store.locations import Checkpoint, Location, S3Config, S3Location, location
from exactresume.store.lock import FolderLock
from exactresume.store.resume import capture, check_parts, check_step, for_one_file, per_rank, restore, started_fresh
from exactresume.store.save_gate import SaveGate
from exactresume.world import World, given_world, launched_by_torchrun

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

NAMED = 3  # checkpoints a refusal names before "and N more"


class Place(Protocol):
    """Where a store's checkpoints live: a folder on a disk (disk.py) or a prefix of a bucket (s3/prefix.py)."""

    folder: Location

    def hold_lock(self) -> None: ...
    def release(self) -> None: ...
    def checkpoints(self, layout: Layout) -> list[Checkpoint]: ...
    def leftovers(self, layout: Layout) -> list[Location]: ...
    def set_aside(self) -> list[Location]: ...
    def remove_leftovers(self, layout: Layout) -> list[Location]: ...
    def unwritable(self, error: OSError) -> str | None: ...
    def prepare(self, checkpoint: Checkpoint, layout: Layout) -> None: ...
    def write_file(
        self, checkpoint: Checkpoint, state: dict, faults: FaultPoints, before_publish: Callable[[], None] | None
    ) -> None: ...
    def write_sharded(
        self,
        checkpoint: Checkpoint,
        parts: Mapping[str, Stateful],
        world: World,
        identity: dict | None,
        faults: FaultPoints,
    ) -> None: ...
    def read(self, checkpoint: Checkpoint, layout: Layout) -> Any: ...
    def verifies(self, checkpoint: Checkpoint, layout: Layout) -> bool: ...
    def delete(self, older: list[Checkpoint], layout: Layout) -> None: ...


class CheckpointStore:
    """Numbered checkpoints in one folder or `s3://` prefix: save, list, restore the newest valid one,
    keep the newest `keep`.

    A checkpoint that `load` found but could not load (the parts given differ, it is another run's, or
    every checkpoint of the folder is damaged) is never written over or deleted by this store: every
    `save` refuses until a `load` succeeds (with `skip=` / `fresh=` / `any_identity=`) or the file is
    moved away. Nor does a save at a step that a verified checkpoint of the folder has reached, unless
    this store loaded or wrote it: a loop that forgot to load cannot write over its own run.
    """

    def __init__(
        self,
        folder: Path | str | S3Location,
        keep: int | None = 3,
        notify: Callable[[str], None] = notice,
        lock: FolderLock | None = None,
        background: bool = False,
        copy: str | None = None,
        world: World | None = None,
        sharded: bool = False,
        identity: dict | None = None,
        config: S3Config | None = None,
        wait_lock: float = 0.0,
    ):
        """`lock`: the folder's lock, held by the caller (a training job's); `config` and `wait_lock`: how
        an `s3://` prefix is reached, and how long a save waits for another run's lease to end."""
        self.keep, self.faults = check_keep(keep), FaultPoints.from_environment()
        self.layout = SHARDED if sharded else ONE_FILE
        self.place = _place(folder, notify, lock, self.faults, config, wait_lock)
        self.folder: Location = self.place.folder
        self.identity, self.gate = check_identity(identity), SaveGate()
        self.world, self.writer = _saving_world(background, copy, world, sharded), None
        self.coalesced = 0  # saves skipped by `coalesce` because the one before was still being written
        self.held_skips: list[Skipped] | None = None  # what `load_newest` passed over, not said yet
        if background and self.world.is_main:
            self.writer = BackgroundWriter(self, copy or BEFORE_RETURN)

    @property
    def notify(self) -> Callable[[str], None]:
        """Where the store's lines go (a skipped checkpoint, one set aside, a failed pruning)."""
        return self.place.notify

    @notify.setter
    def notify(self, notify: Callable[[str], None]) -> None:
        self.place.notify = notify

    # -- what is there -----------------------------------------------------------------------------

    def path_for(self, step: int) -> Location:
        return self.folder / self.layout.name(step)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints of the store, oldest step first (names only; nothing is read)."""
        return self.place.checkpoints(self.layout)

    def leftovers(self) -> list[Location]:
        """What saves that a crash interrupted left: `.tmp` files and folders, or uncommitted objects."""
        return self.place.leftovers(self.layout)

    def set_aside(self) -> list[Location]:
        """Checkpoints a save renamed `NAME.unreadable` rather than write over them: kept, never read."""
        return self.place.set_aside()

    def verifies(self, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint's bytes match their checksums (nothing is unpickled)."""
        return self.place.verifies(checkpoint, self.layout)

    def remove_leftovers(self) -> list[Location]:
        """Delete the leftovers of interrupted saves (under the lock or lease); returns what was removed."""
        with self._one_writer():
            return self.place.remove_leftovers(self.layout)

    def hold_lock(self) -> None:
        """Take the folder's lock (or the prefix's lease) for this store's writes, else UserError."""
        with self._one_writer():
            self.place.hold_lock()

    def release(self) -> None:
        """Let another store write the folder."""
        self.place.release()

    # -- saving ------------------------------------------------------------------------------------

    def save(self, step: int, parts: Mapping[str, Stateful], coalesce: bool = False) -> Location | None:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones; where it is.

        In the background, it returns once the state is copied (or at once: background.py), and with
        `coalesce` a save asked for while the one before is still being written is skipped (None).
        Under many processes every rank calls it, and every rank skips together."""
        check_parts(parts)
        if self.layout.sharded:
            return self._save_sharded(step, per_rank(parts, self.world))
        parts = for_one_file(parts, self.world, "CheckpointStore(folder, sharded=True, world=World.from_env())")
        if self.skips(coalesce):
            return None
        if not self.world.is_main:
            capture(parts, step)  # takes part in gathering the per-rank parts; rank 0 writes
            path = self.path_for(check_step(step))
        elif self.writer is not None:
            path = self.writer.save(step, parts)
        else:
            step = self.check_save(step)
            with self._told_as_one_line(step):
                self.faults.reached("snapshot")
                self.commit(step, capture(parts, step, self.identity))
            self.reached(step)
            path = self.path_for(step)
        self.world.barrier()
        return path

    def _save_sharded(self, step: int, parts: Mapping[str, Stateful]) -> Location:
        """Every rank writes its shard of the checkpoint at `step`; rank 0 prepares, commits and prunes."""
        step = self.check_save(step)  # every rank reads the same folder, so every rank decides alike
        checkpoint = Checkpoint(step, self.path_for(step))
        if self.world.is_main:
            with self._told_as_one_line(step):
                self._prepare(checkpoint)
        self.world.barrier()
        with self._told_as_one_line(step):
            self.faults.reached("snapshot")
            self.place.write_sharded(checkpoint, parts, self.world, self.identity, self.faults)
        self.reached(step)
        if self.world.is_main:
            self._retain(step)
        self.world.barrier()
        return checkpoint.path

    @contextlib.contextmanager
    def _told_as_one_line(self, step: int) -> Iterator[None]:
        """The storage's refusal of the save at `step`, as the store's one line for it (`storage_error`)."""
        try:
            yield
        except OSError as error:
            raise self.storage_error(step, error) from error

    def _prepare(self, checkpoint: Checkpoint) -> None:
        self.hold_lock()
        self.place.prepare(checkpoint, self.layout)

    def commit(self, step: int, state: dict, before_publish: Callable[[], None] | None = None) -> Location:
        """A one-file checkpoint's stages after the snapshot: write, verify (the location's), retention.

        `state` must not change while this runs (background.py hands it a private copy).
        `before_publish()` runs just before it is published: if it raises, nothing is (background.py)."""
        checkpoint = Checkpoint(step, self.path_for(step))
        self._prepare(checkpoint)
        self.place.write_file(checkpoint, state, self.faults, before_publish)
        self._retain(step)
        return checkpoint.path

    def skips(self, coalesce: bool) -> bool:
        """With `coalesce`, whether a save asked for now is skipped (and counted in `coalesced`) because
        the one before is still being written; under many processes every rank answers the same."""
        if coalesce and self.world.any(self.busy()):
            self.coalesced += 1
            return True
        return False

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

    def storage_error(self, step: int, error: OSError) -> StorageError:
        """The one line for a save that the storage refused: what failed, why, and what is intact (where the
        folder can still be listed), or that no save can succeed there; its cause is `error`."""
        try:
            existing = self.checkpoints()
            after = f"; {existing[-1].path} is intact" if existing else "; no earlier checkpoint exists"
        except OSError:
            after = ""
        unwritable = self.place.unwritable(error)
        after += f"; {unwritable}" if unwritable else ""
        refused = StorageError.from_os_error(f"the checkpoint at step {step} in {self.folder}", error, after)
        refused.__cause__ = error
        return refused

    def _retain(self, step: int) -> None:
        """Delete all but the newest `keep` checkpoints up to `step`; a failure here only warns."""
        if self.keep is None:
            return
        older = self.gate.prunable(self.checkpoints(), step)[: -self.keep]
        try:
            self.faults.reached("retention")
            self.place.delete(older, self.layout)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {self.folder}: {error.strerror or error}")

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

    # -- background saves --------------------------------------------------------------------------

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

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> None:
        try:
            self.close()
        except Exception:
            if error is None:
                raise
            # else the error in flight is the one raised, not a background save's

    # -- loading -----------------------------------------------------------------------------------

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
        per-rank parts (or its shards), and only rank 0 cleans.
        """
        check_parts(parts)  # a mistake in the call is named before anything is read or cleaned
        if self.layout.sharded:
            from exactresume.store.sharded import sharded_parts  # DCP takes a second to import: only when used

            parts = sharded_parts(parts)
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

    def load_newest(self) -> tuple[Checkpoint, dict] | None:
        """The newest checkpoint that verifies, with its state; each one passed over is named to `notify`."""
        for checkpoint in reversed(self.checkpoints()):
            try:
                state = self.place.read(checkpoint, self.layout)
            except CheckpointError as error:  # its bytes do not verify
                self._skipped(checkpoint, error, damaged=True)
                continue
            try:
                return checkpoint, check_checkpoint(checkpoint, state)
            except CheckpointError as error:  # sound bytes, but not a checkpoint this release reads
                self._skipped(checkpoint, error, damaged=False)
        return None

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

    def _skipped(self, checkpoint: Checkpoint, error: CheckpointError, damaged: bool) -> None:
        """Say that `checkpoint` was passed over on the way to an older one, and why; keep it from retention.
        Inside `newest_loadable` it is said only once an older one is found."""
        self.gate.pass_over(checkpoint.path)
        if self.held_skips is not None:
            self.held_skips.append(Skipped(checkpoint, error, damaged))
        else:
            self.notify(Skipped(checkpoint, error, damaged).line())


def store_reading(folder: Location, notify: Callable[[str], None]) -> CheckpointStore:
    """A store that reads `folder` (nothing pruned) in the layout of its newest checkpoint: sharded where
    that one is a sharded folder."""
    one_file, sharded = (CheckpointStore(folder, keep=None, notify=notify, sharded=s, world=World()) for s in (0, 1))
    newest = {store: max((c.step for c in store.checkpoints()), default=-1) for store in (one_file, sharded)}
    return sharded if newest[sharded] > newest[one_file] else one_file


def _place(
    folder: Path | str | S3Location,
    notify: Callable[[str], None],
    lock: FolderLock | None,
    faults: FaultPoints,
    config: S3Config | None,
    wait_lock: float,
) -> Place:
    """The folder on a disk, or the prefix on an object store, that `folder` names."""
    if not isinstance(folder, (str, os.PathLike, S3Location)):
        raise FieldError(f"folder must be a path, got a {type(folder).__name__}", "folder")
    if not isinstance(folder, S3Location) and not os.fspath(folder):  # Path("") is the current folder
        raise FieldError("folder must be a folder's path, got an empty one", "folder")
    where = location(folder, config)
    if isinstance(where, S3Location):
        from exactresume.store.s3.prefix import S3Prefix  # boto3 only where a store is remote

        return S3Prefix(where, notify, faults, wait_lock)
    return DiskFolder(where, notify, lock)


def _saving_world(background: bool, copy: str | None, world: World | None, sharded: bool) -> World:
    """The processes that save together (rank 0 writes a one-file checkpoint), once the options that
    decide how a save runs are checked: a sharded store is torchrun's world unless given one."""
    if not isinstance(background, bool):
        raise FieldError(f"background must be True or False, got {background!r}", "background")
    if copy is not None and not background:
        raise FieldError("copy= says how a background save copies the state: give background=True with it", "copy")
    if sharded and background:
        raise FieldError("a sharded store saves in the foreground: every rank writes its shard", "background")
    return given_world(world, World.from_env() if sharded else World())


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


__all__ = ["CheckpointStore", "store_reading"]
