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
checkpoint and loads none of another run (identity.py), `key=` seals every file, shard checksum and
commit with that key's MAC and reads only checkpoints sealed with it (seal_hash.py; by default
`EXACTRESUME_KEY` decides).

`parts` maps names to objects with `state_dict()` / `load_state_dict()` (a model, an optimizer, a
batch generator wrapper, `GlobalRng()`, ...). A checkpoint is a resume file (resume.py) plus the step
it was saved at: `torch.load(path, weights_only=True)` gives every part under its name. A save is

    gate (may it run?) -> snapshot -> write and verify (the location's stages) -> retention

so a kill at any moment leaves either no new checkpoint or a complete one, and older ones are deleted
only after the new one is durable and reads back verified. A model sharded over the ranks (FSDP2) is
saved as it is sharded and loaded back into however it is sharded then.

`load` walks from the newest checkpoint down (newest.py), skips (and names) any that is damaged, and never starts
a run fresh over checkpoints it could not load: a folder whose every checkpoint is damaged is refused,
naming them. A checkpoint that `load` found but could not load is never written over or deleted by
this store (save_gate.py). One writer per location: the first save, or a load that cleans up, takes
the folder's lock or the prefix's lease until `close()` (or the end of a `with` block); a second
store writing the same place is refused naming the holder. Listing and `load_newest` take no lock.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exactresume.config import check_keep
from exactresume.errors import CheckpointError, FieldError, StorageError, UserError, a_kind_of, notice
from exactresume.store.background import BEFORE_RETURN, BackgroundWriter
from exactresume.store.disk import DiskFolder
from exactresume.store.faults import FaultPoints
from exactresume.store.identity import check_identity, refuse_another_run
from exactresume.store.layout import ONE_FILE, SHARDED
from exactresume.store.locations import Checkpoint, Location, S3Config, S3Location, is_s3, location
from exactresume.store.lock import FolderLock
from exactresume.store.newest import NewestSearch, listed, place_of
from exactresume.store.place import Place, Publishing
from exactresume.store.refusals import (
    ANOTHER_RUN_WAY_OUT,
    another_run_saves,
    misfit_saves,
    other_layout,
    sealed_otherwise_saves,
)
from exactresume.store.resume import capture, check_parts, check_step, for_one_file, per_rank, restore, started_fresh
from exactresume.store.save_gate import SaveGate
from exactresume.store.seal_hash import SealError, keyed, sealing, sealing_for
from exactresume.store.serializer import THREAD
from exactresume.store.tiers import DurableCopy
from exactresume.world import World, given_world, launched_by_torchrun

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


def _sealed_with_its_key(method: Callable) -> Callable:
    """A store method run with the store's sealing in force (its key, or none), whatever the environment says."""

    @functools.wraps(method)
    def run(self: CheckpointStore, *args: Any, **kwargs: Any) -> Any:
        with keyed(self.sealing):
            return method(self, *args, **kwargs)

    return run


class CheckpointStore:
    """Numbered checkpoints in one folder or `s3://` prefix: save, list, restore the newest valid one,
    keep the newest `keep`.

    A checkpoint that `load` found but could not load (the parts given differ, it is another run's, or
    every checkpoint of the folder is damaged) is never written over or deleted by this store: every
    `save` refuses until a `load` succeeds (with `skip=` / `fresh=` / `any_identity=`) or the file is
    moved away. Nor does a save at a step that a verified checkpoint of the folder has reached, unless
    this store loaded or wrote it: a loop that forgot to load cannot write over its own run, and one that
    saves past it prunes nothing older than its own first save.
    """

    def __init__(
        self,
        folder: Path | str | S3Location,
        keep: int | None = 3,
        notify: Callable[[str], None] = notice,
        lock: FolderLock | None = None,
        background: bool = False,
        copy: str | None = None,
        serializer: str | None = None,
        world: World | None = None,
        sharded: bool = False,
        identity: dict | None = None,
        config: S3Config | None = None,
        wait_lock: float = 0.0,
        local: Path | str | None = None,
        durable_every: int | None = None,
        key: str | bytes | None = None,
    ):
        """`lock`: the folder's lock, held by the caller (a training job's); `config` and `wait_lock`: how
        an `s3://` prefix is reached, and how long a save waits for another run's lease to end; `local`
        and `durable_every`: every save to the folder `local`, every `durable_every`-th step copied to
        `folder` (tiers.py); `key`: the secret every seal is a MAC of (by default `EXACTRESUME_KEY`'s)."""
        self.sealing = sealing_for(key) or sealing()  # the environment read once: a store seals one way
        self.keep, self.faults = check_keep(keep), FaultPoints.from_environment()
        self.layout = SHARDED if sharded else ONE_FILE
        self.place = _place(folder, notify, lock, self.faults, config, wait_lock)
        self.places, self.durable = [self.place], None  # where checkpoints are read: the landing tier first
        if local is not None or durable_every is not None:
            self._add_local_tier(local, durable_every)
        self.folder: Location = self.place.folder
        self.identity, self.gate = check_identity(identity), SaveGate()
        self.world, self.writer = _saving_world(background, copy, world, sharded, serializer), None
        self.coalesced = 0  # saves skipped by `coalesce` because the one before was still being written
        self.closed = False
        # checkpoints found to verify, and to be sealed otherwise (SealError), by path: each read once
        self.sound: frozenset[Location] = frozenset()
        self.sealed_otherwise: dict[Location, str] = {}
        if background and self.world.is_main:
            self.writer = BackgroundWriter(self, copy or BEFORE_RETURN, serializer or THREAD)

    def _add_local_tier(self, local: Path | str | None, durable_every: int | None) -> None:
        """Saves land in the folder `local`; every `durable_every`-th step is copied to the store's folder."""
        if local is None or durable_every is None:
            given, missing = ("local", "durable_every") if durable_every is None else ("durable_every", "local")
            raise FieldError(f"{given}= and {missing}= go together: a local tier, and which steps go durable", missing)
        if self.layout.sharded:
            raise FieldError("a local tier holds one-file checkpoints; a sharded store saves to its folder", "local")
        if is_s3(local) or not isinstance(local, (str, os.PathLike)) or not os.fspath(local):
            raise FieldError(f"local= is a folder on this machine's disk, got {local!r}", "local")
        durable, landing = self.place, DiskFolder(Path(local), self.notify)
        if isinstance(durable.folder, Path) and os.path.realpath(durable.folder) == os.path.realpath(landing.folder):
            raise FieldError(
                f"local= is the store's own folder ({local}): give the local tier a folder of its own", "local"
            )
        self.place, self.places = landing, [landing, durable]
        self.durable = DurableCopy(durable, self.layout, durable_every, self._retain_durable, self._durable_refused)

    @property
    def notify(self) -> Callable[[str], None]:
        """Where the store's lines go (a skipped checkpoint, one set aside, a failed pruning)."""
        return self.place.notify

    @notify.setter
    def notify(self, notify: Callable[[str], None]) -> None:
        for place in self.places:
            place.notify = notify

    # -- what is there -----------------------------------------------------------------------------

    def path_for(self, step: int) -> Location:
        return self.folder / self.layout.name(step)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints of the store, oldest step first (names only; nothing is read); with a local tier,
        both tiers', a step in both listed durable first (a load tries the newest, and the local one first)."""
        return listed(self.places, self.layout)

    def leftovers(self) -> list[Location]:
        """What saves that a crash interrupted left: `.tmp` files and folders, or uncommitted objects."""
        return [path for place in self.places for path in place.leftovers(self.layout)]

    def set_aside(self) -> list[Location]:
        """Checkpoints a save renamed `NAME.unreadable` rather than write over them: kept, never read."""
        return [path for place in self.places for path in place.set_aside()]

    @_sealed_with_its_key
    def verifies(self, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint's bytes match their checksums (nothing is unpickled)."""
        try:
            return self._place_of(checkpoint).verifies(checkpoint, self.layout)
        except SealError:
            return False

    def _may_be_sound(self, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint verifies, or is sealed otherwise than this store seals (another key, or
        none: seal_hash.SealError), when it may be sound work a store must not prune or save beside."""
        if checkpoint.path in self.sound:
            return True
        try:
            verified = self._place_of(checkpoint).verifies(checkpoint, self.layout)
        except SealError as error:
            self.sealed_otherwise[checkpoint.path] = str(error)
            return True
        if verified:
            self.sound = self.sound | {checkpoint.path}
        return verified

    def _place_of(self, checkpoint: Checkpoint) -> Place:
        return place_of(self.places, checkpoint)

    @_sealed_with_its_key
    def remove_leftovers(self) -> list[Location]:
        """Delete the leftovers of interrupted saves (under the lock or lease); returns what was removed."""
        with self._one_writer():
            return [path for place in self.places for path in place.remove_leftovers(self.layout)]

    def hold_lock(self) -> None:
        """Take the folder's lock (or the prefix's lease) for this store's writes, else UserError."""
        with self._one_writer():
            for place in self.places:
                place.hold_lock()

    def release(self) -> None:
        """Let another store write the folder."""
        for place in self.places:
            place.release()

    # -- saving ------------------------------------------------------------------------------------

    @_sealed_with_its_key
    def save(self, step: int, parts: Mapping[str, Stateful], coalesce: bool = False) -> Location | None:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones; where it is.

        In the background, it returns once the state is copied (or at once: background.py), and with
        `coalesce` a save asked for while the one before is still being written is skipped (None).
        Under many processes every rank calls it, and every rank skips together."""
        self._check_open()
        check_parts(parts)
        if self.layout.sharded:
            return self._save_sharded(step, per_rank(parts, self.world))
        parts = for_one_file(parts, self.world, "CheckpointStore(folder, sharded=True, world=World.from_env())")
        if self.skips(step, coalesce):
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
        with self._told_as_one_line(step):  # the place's write meets the ranks before any of them writes
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
        self.place.prepare(checkpoint, self.layout, not_ours=checkpoint.path in self.gate.passed_over)

    @_sealed_with_its_key
    def commit(self, step: int, state: dict, publishing: Publishing | None = None) -> Location:
        """A one-file checkpoint's stages after the snapshot: write, verify (the location's), retention.

        `state` must not change while this runs (background.py hands it a private copy). `publishing` is
        told just before the checkpoint is published (if it raises, nothing is) and once it is durable at its
        name, before it is read back (background.py)."""
        checkpoint = Checkpoint(step, self.path_for(step))
        self._prepare(checkpoint)
        self.place.write_file(checkpoint, state, self.faults, publishing or Publishing())
        self._retain(step)
        if self.durable is not None:
            self.durable.landed(checkpoint)
        return checkpoint.path

    def skips(self, step: Any, coalesce: bool) -> bool:
        """With `coalesce`, whether a save asked for now is skipped (and counted in `coalesced`) because
        the one before is still being written; under many processes every rank answers the same. A step
        that is no step, or one before the save in flight, is never skipped: it is refused, as without."""
        step = check_step(step)
        going_back = self.writer is not None and self.writer.step is not None and step < self.writer.step
        if coalesce and self.world.any(self.busy() and not going_back):
            self.coalesced += 1
            return True
        return False

    def check_save(self, step: Any) -> int:
        """The step to save at, or a one-line error when this store must not save (save_gate.py)."""
        step = check_step(step)
        if self.gate.ours_up_to is None:  # neither loaded nor saved yet: once
            self._refuse_the_other_layout(ahead_of=step - 1)
        try:
            self.gate.check(step, self.folder, self._gated_checkpoints(), self._may_be_sound)
        except CheckpointError as refused:
            bar = self.gate.bar
            if bar is None or str(refused) != bar.line or bar.checkpoint.path not in self.sealed_otherwise:
                raise
            # not damage nor another run: the key differs, and the line says so
            barred = bar.checkpoint
            self.gate.refuse(barred, sealed_otherwise_saves(barred.path, self.sealed_otherwise[barred.path]))
            raise CheckpointError(self.gate.bar.line) from None
        return step

    def _gated_checkpoints(self) -> list[Checkpoint]:
        """What a save is checked against: both tiers' checkpoints until the store has loaded or saved, then
        the local tier's alone. The durable tier is written only by this store's copies of its own steps
        (its lock or lease keeps others out), and is not listed on the loop's thread at every save: a slow
        or unreachable durable tier costs durable checkpoints, not training time."""
        known = self.gate.ours_up_to is not None or self.gate.saved_from is not None
        if self.durable is None or not known or self.gate.bar is not None:
            return self.checkpoints()
        return listed([self.place], self.layout)

    def reached(self, step: int) -> None:
        """A save at `step` is durable."""
        self.gate.saved(step, self.path_for(step))
        self.sound = self.sound | {self.path_for(step)}

    def continue_from(self, step: int, loaded_here: bool = False) -> None:
        """The run this store writes was resumed at `step` from elsewhere: its checkpoints up to there are its own.
        `loaded_here`: from this store's own checkpoints, by a search that passed over each later one that
        does not verify (damaged, or sealed otherwise: a forged file, another key's): kept from retention
        and set aside at its step, as after this store's own `load`, not a bar to every save."""
        self.gate.resumed_at(step)
        if loaded_here:
            for checkpoint in self.checkpoints():
                if checkpoint.step > step and not self.verifies(checkpoint):
                    self.gate.pass_over(checkpoint.path)

    def storage_error(self, step: int, error: OSError, place: Place | None = None) -> StorageError:
        """The one line for a save that the storage refused (in `place`: by default the tier saves land in):
        what failed, why, and what is intact (where the folder can still be listed), or that no save can
        succeed there; its cause is `error`."""
        place = place or self._place_named_by(error)
        try:
            existing = self.checkpoints()
            after = f"; {existing[-1].path} is intact" if existing else "; no earlier checkpoint exists"
        except OSError:
            after = ""
        unwritable = place.unwritable(error)
        after += f"; {unwritable}" if unwritable else ""
        refused = StorageError.from_os_error(f"the checkpoint at step {step} in {place.folder}", error, after)
        refused.__cause__ = error
        return refused

    def _place_named_by(self, error: OSError) -> Place:
        """The tier whose folder holds the file `error` names (the durable one's lock, say); else the landing one."""
        named = Path(os.fsdecode(error.filename)) if isinstance(error.filename, (str, bytes, os.PathLike)) else None
        for place in self.places:
            if named is not None and isinstance(place.folder, Path) and named.is_relative_to(place.folder):
                return place
        return self.place

    def _retain(self, step: int, place: Place | None = None) -> None:
        """Delete all but the newest `keep` checkpoints up to `step` of `place` (the tier saves land in),
        the one just written at `step` counted as any (one passed over there by the load was set aside);
        a failure here only warns."""
        place = place or self.place
        self.gate.saved(step, place.folder / self.layout.name(step))
        if self.keep is None:
            return
        older = self.gate.prunable(place.checkpoints(self.layout), step)[: -self.keep]
        if place is not self.places[-1]:  # a local tier another run may share: only this run's go
            older = [checkpoint for checkpoint in older if self._saved_by_this_run(checkpoint)]
        older = [checkpoint for checkpoint in older if not self._of_another_sealing(checkpoint)]
        try:
            self.faults.reached("retention")
            place.delete(older, self.layout)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {place.folder}: {error.strerror or error}")

    def _of_another_sealing(self, checkpoint: Checkpoint) -> bool:
        """Whether `checkpoint` is sealed otherwise than this store seals: kept, as sound work of another key."""
        self._may_be_sound(checkpoint)  # read once (a checkpoint this store wrote is known)
        return checkpoint.path in self.sealed_otherwise

    def _saved_by_this_run(self, checkpoint: Checkpoint) -> bool:
        """Whether a local tier's checkpoint holds this store's identity (any, without one), read without
        its tensors' bytes; one that cannot be read is not known to be this run's, and stays."""
        if self.identity is None:
            return True
        try:
            refuse_another_run(
                torch.load(checkpoint.path, mmap=True, weights_only=True), self.identity, checkpoint.path
            )
        except Exception:  # damaged, or another run's: kept, as a load would pass it over
            return False
        return True

    def _retain_durable(self, step: int) -> None:
        self._retain(step, self.places[-1])

    def _durable_refused(self, step: int, error: OSError) -> StorageError:
        return self.storage_error(step, error, self.places[-1])

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
        """Block until the last save is durable, and its copy to the durable tier is in; or raise its error."""
        if self.writer is not None:
            self.writer.wait()
        if self.durable is not None:
            self.durable.wait()

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
        """Wait for the save in flight (with two tiers, and copy the newest local checkpoint to the durable
        tier when its step is not there yet), then let another store write the folder (`release`); the
        store saves and loads no more."""
        try:
            if self.writer is not None:
                self.writer.close()
            if self.durable is not None:
                self.durable.finish()  # the last step durable too, copied if it was not due
        finally:
            self.closed = True
            self.release()

    def _check_open(self) -> None:
        if self.closed:
            named = " and ".join(str(place.folder) for place in reversed(self.places))  # as given: durable first
            raise UserError(f"the store of {named} is closed: make a new CheckpointStore to save or load again")

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

    @_sealed_with_its_key
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
        per-rank parts (or its shards), and only rank 0 cleans. A background save still in flight is
        waited for first (its error raised), so that the newest checkpoint is the last one saved.
        """
        self._check_open()
        check_parts(parts)  # a mistake in the call is named before anything is read or cleaned
        self.wait()
        if self.layout.sharded:
            from exactresume.store.sharded import sharded_parts  # DCP takes a second to import: only when used

            parts = sharded_parts(parts)
        parts = per_rank(parts, self.world)
        if clean and self.world.is_main:
            self.remove_leftovers()
        self._refuse_the_other_layout(ahead_of=max((c.step for c in self.checkpoints()), default=-1))
        found = self.newest_loadable()
        if found is None:
            return None
        checkpoint, state = found
        self._say_if_the_local_tier_was_lost(checkpoint)
        if not any_identity:
            self._check_run(checkpoint, state)
        try:
            starting = restore(state, parts, skip=skip, fresh=fresh, source=checkpoint.path)
        except CheckpointError:
            self.gate.refuse(checkpoint, misfit_saves(checkpoint))
            raise
        self.gate.loaded(checkpoint.step)
        for name in starting:
            self.notify(started_fresh(checkpoint.path, name))
        return checkpoint.step

    def _refuse_the_other_layout(self, ahead_of: int) -> None:
        """CheckpointError when the folder holds a checkpoint of the other layout past step `ahead_of`: a
        store that forgot `sharded=True` (or gave it to one-file checkpoints) would start fresh beside them."""
        other = ONE_FILE if self.layout.sharded else SHARDED
        theirs = listed(self.places, other)
        newest = max(theirs, key=lambda checkpoint: checkpoint.step, default=None)
        if newest is not None and newest.step > ahead_of:
            raise CheckpointError(other_layout(newest, self.layout.sharded))

    def _say_if_the_local_tier_was_lost(self, checkpoint: Checkpoint) -> None:
        """A local tier with no checkpoint beside a durable one that has: a new machine, or a wiped folder."""
        if self.durable is not None and not self.place.checkpoints(self.layout):
            self.notify(
                f"the local tier {self.place.folder} holds no checkpoint (a new machine, or its folder wiped): "
                f"resuming from {checkpoint.path}, the durable tier's newest"
            )

    @_sealed_with_its_key
    def load_newest(self, places: list[Place] | None = None) -> tuple[Checkpoint, dict] | None:
        """The newest checkpoint that verifies (of `places`: by default every tier's), with its state; each
        one passed over is named to `notify`. A local tier's checkpoint must also be this run's (its identity)."""
        return self._search().newest(places)

    @_sealed_with_its_key
    def newest_loadable(self) -> tuple[Checkpoint, dict] | None:
        """`load_newest`, but a folder whose every checkpoint it passes over is refused (CheckpointError
        naming them), not taken for an empty one: None only when there is no checkpoint at all. Each
        checkpoint passed over on the way to an older one is named to `notify` (newest.py)."""
        return self._search().newest_loadable()

    def _search(self) -> NewestSearch:
        return NewestSearch(self.places, self.layout, self.identity, self.gate, self.world, self.notify)

    def _check_run(self, checkpoint: Checkpoint, state: dict) -> None:
        """CheckpointError when `checkpoint` is not this store's run by its identity; saves refuse then."""
        try:
            refuse_another_run(state, self.identity, checkpoint.path, ANOTHER_RUN_WAY_OUT)
        except CheckpointError:
            self.gate.refuse(checkpoint, another_run_saves(checkpoint))
            raise


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
        raise FieldError(f"folder must be a path, got {a_kind_of(folder)}", "folder")
    if not isinstance(folder, S3Location) and not os.fspath(folder):  # Path("") is the current folder
        raise FieldError("folder must be a folder's path, got an empty one", "folder")
    where = location(folder, config)
    if isinstance(where, S3Location):
        from exactresume.store.s3.prefix import S3Prefix  # boto3 only where a store is remote

        return S3Prefix(where, notify, faults, wait_lock)
    return DiskFolder(where, notify, lock)


def _saving_world(
    background: bool, copy: str | None, world: World | None, sharded: bool, serializer: str | None
) -> World:
    """The processes that save together (rank 0 writes a one-file checkpoint), once the options that
    decide how a save runs are checked: a sharded store is torchrun's world unless given one."""
    if not isinstance(background, bool):
        raise FieldError(f"background must be True or False, got {background!r}", "background")
    if copy is not None and not background:
        raise FieldError("copy= says how a background save copies the state: give background=True with it", "copy")
    if serializer is not None and not background:
        raise FieldError(
            "serializer= says where a background save is pickled: give background=True with it", "serializer"
        )
    if sharded and background:
        raise FieldError("a sharded store saves in the foreground: every rank writes its shard", "background")
    return given_world(world, World.from_env() if sharded else World())


__all__ = ["CheckpointStore", "store_reading"]
