"""A folder of numbered checkpoints that survives kill -9, full disks and damaged files.

    store = CheckpointStore("runs/a/checkpoints", keep=3)
    step = store.load(parts)       # newest valid checkpoint into `parts`: its step, or None when there is none
    store.save(step, parts)        # FOLDER/step-00000030.pth, durable and verified; older ones pruned

`background=True` saves in a writer thread (background.py), `world=` makes every rank of a run
call `save` and `load` while rank 0 writes (numbered.py), and an `s3://` prefix in place of the
folder makes an S3CheckpointStore (s3/folder.py): one face for every way a run saves.

`parts` maps names to objects with `state_dict()` / `load_state_dict()` (a model, an optimizer, a
batch generator wrapper, `GlobalRng()`, ...). A checkpoint is a resume file (resume.py) plus the
step it was saved at, sealed with its checksum (sealed.py): `torch.load(path, weights_only=True)`
gives every part under its name, as its object's `state_dict()`.
`save` is one sequence of stages, each a fault-injection point (faults.py; the write itself is
atomic.atomic_write's):

    snapshot -> write (serialize + checksum) -> fsync -> rename -> folder fsync -> verify -> retention

so a kill at any moment leaves either no new file or a complete one, and older checkpoints are
deleted only after the new one is durable and reads back with the right checksum. `restore` walks
from the newest checkpoint down and skips (and reports) any file that is damaged, foreign or from an
interrupted copy. One process writes a store; that process removes `.tmp` leftovers of a crashed
save when it loads.

`CheckpointStore(folder, sharded=True, world=...)` is a ShardedCheckpointStore: each checkpoint is a
sharded folder `step-00000030.dcp` as `save_resume(..., sharded=True)` writes one (sharded.py), of
which every rank writes its shard, written as NAME.tmp/ and renamed once committed. A model sharded
over the ranks (FSDP2) is saved as it is sharded and loaded back into however it is sharded then.
Rank 0 holds the lock, cleans and prunes; every rank calls `save` and `load`.

One writer per folder is enforced: the first save, or a load that cleans up, locks the folder
(lock.py) until `close()` (or the end of a `with` block, or of the process); a second store writing
the same folder, in this process or another, is refused with a UserError naming the holder. A store
inside a folder its caller has locked already (a training job's output folder) is given that lock
(`lock=`) and takes none of its own. Listing and `load_newest` take no lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exactresume.atomic import TMP_SUFFIX, atomic_write, fsync_path
from exactresume.config import check_keep
from exactresume.errors import CheckpointError, FieldError, ReadBackError, StorageError, UserError, notice
from exactresume.store.faults import FaultPoints
from exactresume.store.locations import S3Location, is_s3
from exactresume.store.lock import FolderLock
from exactresume.store.numbered import (
    CHECKPOINT_NAME,
    UNREADABLE_SUFFIX,
    Checkpoint,
    NumberedStore,
    check_checkpoint,
    checkpoint_name,
)
from exactresume.store.resume import check_parts, per_rank, tensors_in
from exactresume.store.sealed import load_sealed, verify, write_sealed
from exactresume.world import World, given_world

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})  # a folder one may read but not write


class CheckpointStore(NumberedStore):
    """Numbered checkpoints in one folder: save, list, restore the newest valid one, keep the newest `keep`.

    Given an `s3://bucket/prefix` (a string or an S3Location), it is an S3CheckpointStore (s3/folder.py);
    given `sharded=True`, a ShardedCheckpointStore (below), whose every rank writes its shard.
    """

    checkpoint_names, holds_folders = CHECKPOINT_NAME, False  # step-00000030.pth files

    def __new__(cls, folder: Path | str | S3Location, *args: Any, **kwargs: Any) -> CheckpointStore:
        if cls is not CheckpointStore:
            return super().__new__(cls)
        if kwargs.get("sharded"):
            if is_s3(folder):
                raise FieldError(
                    "a sharded store is a folder on a disk; on an s3:// prefix, save_resume(..., sharded=True)",
                    "sharded",
                )
            kind = ShardedCheckpointStore
        elif is_s3(folder):
            from exactresume.store.s3.folder import S3CheckpointStore  # boto3 only where a store is remote

            kind = S3CheckpointStore
        else:
            return super().__new__(cls)
        store = object.__new__(kind)
        store.__init__(folder, *args, **kwargs)
        return store

    def __init__(
        self,
        folder: Path | str,
        keep: int | None = 3,
        notify: Callable[[str], None] = notice,
        lock: FolderLock | None = None,
        background: bool = False,
        copy: str | None = None,
        world: World | None = None,
        sharded: bool = False,
        identity: dict | None = None,
    ):
        if not isinstance(folder, (str, os.PathLike)):
            raise FieldError(f"folder must be a path, got a {type(folder).__name__}", "folder")
        if not os.fspath(folder):  # Path("") is the current folder: a store there is never what was meant
            raise FieldError("folder must be a folder's path, got an empty one", "folder")
        self.folder, self.keep, self.notify = Path(folder), check_keep(keep), notify
        _refuse_a_file_in_the_way(self.folder)
        self.faults = FaultPoints.from_environment()
        self.lock, self.owns_lock = lock, lock is None  # a caller's lock on a folder that holds this one
        self._set_saving(background, copy, world, identity)

    def hold_lock(self) -> None:
        """Lock the folder for this store's writes (at once if it is free, else UserError); the OSError of a
        lock file that cannot be written, for the write the lock was for to tell (a save, a clean-up)."""
        if self.lock is not None:
            return
        try:
            with self._one_writer():
                self.lock = FolderLock.acquire(self.folder)
        except StorageError as refused:
            if isinstance(refused.__cause__, OSError):
                raise refused.__cause__ from None
            raise

    def release(self) -> None:
        """Let another store write the folder."""
        if self.lock is not None and self.owns_lock:
            self.lock.release()
            self.lock = None

    def path_for(self, step: int) -> Path:
        return self.folder / checkpoint_name(step)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints in the folder, oldest step first (names only; nothing is read)."""
        if not self.folder.is_dir():
            return []
        entries = (entry for entry in os.scandir(self.folder) if entry.is_dir() == self.holds_folders)
        found = (self.checkpoint_names.match(entry.name) for entry in entries)
        return sorted((Checkpoint(int(m.group(1)), self.folder / m.group(0)) for m in found if m), key=lambda c: c.step)

    def leftovers(self) -> list[Path]:
        """`.tmp` files in the folder: saves that a crash interrupted before their rename."""
        if not self.folder.is_dir():
            return []
        return sorted(self.folder / entry.name for entry in os.scandir(self.folder) if entry.name.endswith(TMP_SUFFIX))

    def set_aside(self) -> list[Path]:
        """Checkpoints a save renamed `NAME.unreadable` rather than write over them: kept, never read."""
        if not self.folder.is_dir():
            return []
        return sorted(self.folder / entry.name for entry in os.scandir(self.folder) if _is_set_aside(entry.name))

    def remove_leftovers(self) -> list[Path]:
        """Delete the `.tmp` leftovers of interrupted saves; returns what was removed."""
        if self.folder.is_dir():
            try:
                self.hold_lock()
            except OSError as error:
                raise self._cleaning_refused(error) from error
        removed = self.leftovers()
        for path in removed:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if removed:
            fsync_path(self.folder)
        return removed

    # -- saving: one sequence of stages, each a fault-injection point ---------------------------

    def commit(self, step: int, state: dict, before_publish: Callable[[], None] | None = None) -> Path:
        """The stages after the snapshot: write, fsync, rename, folder fsync, verify, retention.

        `state` must not change while this runs (background.py hands it a private copy).
        `before_publish()` runs just before the rename: if it raises, the file written so far is removed
        and nothing else changes (a background save whose state changed during its copy).
        """
        path = self.path_for(step)
        self._ensure_folder()
        self.hold_lock()
        self._set_aside_if_unreadable(Checkpoint(step, path))
        self._write(path, state, before_publish)
        self._verify_written(path)
        self._retain(step)
        return path

    def storage_error(self, step: int, error: OSError) -> StorageError:
        """The line for a save the storage refused; in a folder this process may not write, no save can
        succeed, and it says so (not the reader's way round it: a reader saves nothing)."""
        refused = super().storage_error(step, error)
        if error.errno not in NOT_WRITABLE:
            return refused
        told = StorageError(
            f"{refused}; {self.folder} is not writable, so no checkpoint can be saved there: "
            "give the store a writable folder"
        )
        told.errno, told.__cause__ = refused.errno, error
        return told

    def _cleaning_refused(self, error: OSError) -> StorageError:
        """The line for a load that could not lock the folder to remove leftovers; where the folder is one
        this process may not write, the reader's way: a load that writes nothing."""
        after = ""
        if error.errno in NOT_WRITABLE:
            after = (
                f"; {self.folder} is not writable, and a reader, which writes nothing there, loads with "
                "store.load(parts, clean=False)"
            )
        return StorageError.from_os_error(f"the lock file of {self.folder}", error, after)

    def _ensure_folder(self) -> None:
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)  # another process may make it at the same moment
            fsync_path(self.folder.parent)

    def _write(self, path: Path, state: dict, before_publish: Callable[[], None] | None) -> None:
        """serialize + checksum -> fsync -> rename -> folder fsync; on any failure no new file remains."""
        reached: list[str] = []

        def stage(name: str) -> None:
            if name == "rename" and before_publish is not None:
                before_publish()
            reached.append(name)
            self.faults.reached(name)

        try:
            atomic_write(path, lambda file: write_sealed(file, state), stage, expected_bytes=_tensor_bytes(state))
        except BaseException:
            if "folder-fsync" in reached:
                _remove_quietly(path)  # a rename we could not make durable is not a checkpoint
            raise

    def _set_aside_if_unreadable(self, existing: Checkpoint) -> None:
        """A file at the step about to be saved that is no checkpoint we can load (damaged, or of another
        release) is renamed `NAME.unreadable`, not written over: its bytes may still matter to someone."""
        path = existing.path
        if not path.exists():
            return
        try:
            check_checkpoint(existing, load_sealed(path))
        except CheckpointError as error:
            aside = _free_name(path.with_name(path.name + UNREADABLE_SUFFIX))
            os.replace(path, aside)
            fsync_path(self.folder)
            self.notify(f"set aside {path} as {aside.name} before saving its step again ({error})")

    def _verify_written(self, path: Path) -> None:
        """Read the new file back and check its checksum; a file that fails is removed."""
        try:
            self.faults.reached("verify")
            verify(path)
        except OSError:
            _remove_quietly(path)
            raise
        except CheckpointError as error:
            _remove_quietly(path)
            raise ReadBackError(errno.EIO, f"the checkpoint read back damaged ({error})") from None

    def verifies(self, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint's bytes match their checksum (nothing is unpickled)."""
        try:
            verify(checkpoint.path)
        except (CheckpointError, OSError):
            return False
        return True

    def _delete(self, older: list[Checkpoint]) -> None:
        for checkpoint in older:
            checkpoint.path.unlink(missing_ok=True)
        if older:
            fsync_path(self.folder)

    # -- restoring ---------------------------------------------------------------------------------

    def load_newest(self) -> tuple[Checkpoint, dict] | None:
        """The newest checkpoint that verifies, with its state; each one passed over is named to `notify`."""
        for checkpoint in reversed(self.checkpoints()):
            try:
                state = load_sealed(checkpoint.path)
            except CheckpointError as error:  # its bytes do not verify
                self.skipped(checkpoint, error, damaged=True)
                continue
            try:
                return checkpoint, check_checkpoint(checkpoint, state)
            except CheckpointError as error:  # sound bytes, but not a checkpoint this release reads
                self.skipped(checkpoint, error, damaged=False)
        return None


SHARDED_CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.dcp$")


def holds_sharded_checkpoints(folder: Path) -> bool:
    """Whether a folder holds checkpoints of a sharded store (it is read as one then)."""
    return Path(folder).is_dir() and any(SHARDED_CHECKPOINT_NAME.match(entry.name) for entry in os.scandir(folder))


class ShardedCheckpointStore(CheckpointStore):
    """Numbered sharded checkpoints in one folder, every rank writing its shard of each."""

    checkpoint_names, holds_folders = SHARDED_CHECKPOINT_NAME, True  # step-00000030.dcp folders

    def __init__(
        self, folder: Path | str, *args: Any, background: bool = False, world: World | None = None, **kwargs: Any
    ):
        """A CheckpointStore's arguments; the world is torchrun's unless given."""
        if background:
            raise FieldError("a sharded store saves in the foreground: every rank writes its shard", "background")
        kwargs.pop("sharded", None)
        super().__init__(folder, *args, world=given_world(world, World.from_env()), **kwargs)

    def path_for(self, step: int) -> Path:
        return (self.folder / checkpoint_name(step)).with_suffix(".dcp")

    def save(self, step: int, parts: Mapping[str, Stateful], coalesce: bool = False) -> Path:
        """Every rank writes its shard of the checkpoint at `step`; rank 0 commits it, then prunes old ones."""
        from exactresume.store.sharded import save_sharded  # DCP takes a second to import: only when used

        check_parts(parts)
        step = self.check_save(step)  # every rank reads the same folder, so every rank decides alike
        path = self.path_for(step)
        if self.world.is_main:
            try:
                self.hold_lock()
                self._ensure_folder()
                self._set_aside_if_damaged(path)
            except OSError as error:
                raise self.storage_error(step, error) from error
        self.world.barrier()
        try:
            self.faults.reached("snapshot")
            save_sharded(path, per_rank(parts, self.world), self.world, step, self.identity)
        except OSError as error:
            raise self.storage_error(step, error) from error
        self.reached(step)
        if self.world.is_main:
            self._retain(step)
        self.world.barrier()
        return path

    def _set_aside_if_damaged(self, path: Path) -> None:
        """A checkpoint folder at the step about to be saved whose files do not verify is renamed
        `NAME.unreadable`, not replaced: its bytes may still matter to someone."""
        if path.is_dir() and not self.verifies(Checkpoint(0, path)):
            aside = _free_name(path.with_name(path.name + UNREADABLE_SUFFIX))
            os.replace(path, aside)
            fsync_path(self.folder)
            self.notify(f"set aside {path} as {aside.name} before saving its step again (its files do not verify)")

    def load(
        self,
        parts: Mapping[str, Stateful],
        skip: Collection[str] = (),
        fresh: Collection[str] = (),
        clean: bool = True,
        any_identity: bool = False,
    ) -> int | None:
        """As a CheckpointStore's `load`, each rank reading the newest checkpoint that verifies whole."""
        from exactresume.store.sharded import sharded_parts

        check_parts(parts)  # before sharded_parts reads them; the load's own check then passes
        return super().load(sharded_parts(parts), skip, fresh, clean, any_identity)

    def verifies(self, checkpoint: Checkpoint) -> bool:
        from exactresume.store.sharded import verify_sharded

        try:
            verify_sharded(checkpoint.path)
        except (CheckpointError, OSError):
            return False
        return True

    def load_newest(self) -> tuple[Checkpoint, dict] | None:
        """The newest checkpoint whose files verify, with its state; each one passed over is named."""
        from exactresume.store.sharded import load_sharded

        for checkpoint in reversed(self.checkpoints()):
            try:
                return checkpoint, check_checkpoint(checkpoint, load_sharded(checkpoint.path))
            except CheckpointError as error:
                self.skipped(checkpoint, error, damaged=True)
        return None

    def _delete(self, older: list[Checkpoint]) -> None:
        for checkpoint in older:
            shutil.rmtree(checkpoint.path, ignore_errors=True)
        if older:
            fsync_path(self.folder)


def _refuse_a_file_in_the_way(folder: Path) -> None:
    """A store whose folder is a file, or lies under one, could never save: refused before it loads as
    empty (a fresh start) and fails only at its first save."""
    for place in (folder, *folder.parents):
        if os.path.isdir(place):
            return
        if not os.path.exists(place):
            continue
        if place == folder:
            raise UserError(f"{folder} is a file, not a folder of checkpoints: give a folder's path")
        raise UserError(f"{folder} cannot be a folder of checkpoints: {place} is a file, not a folder")


def _tensor_bytes(state: Any) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors_in(state))


def _is_set_aside(name: str) -> bool:
    """`step-….pth.unreadable` or `step-….dcp.unreadable`, or `….unreadable.N` when that name was taken (_free_name)."""
    checkpoint, found, number = name.partition(UNREADABLE_SUFFIX)
    named = CHECKPOINT_NAME.match(checkpoint) or SHARDED_CHECKPOINT_NAME.match(checkpoint)
    return bool(found and named and (not number or re.fullmatch(r"\.\d+", number)))


def _free_name(path: Path) -> Path:
    """`path`, or `path.2`, `path.3`, ... : the first name not taken."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
