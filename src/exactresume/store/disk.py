"""Where a store keeps its checkpoints on a disk: a folder, written by one process under its lock.

A one-file checkpoint is written in stages, each a fault-injection point (faults.py; the write itself
is atomic.atomic_write's):

    write (serialize + checksum) -> fsync -> rename -> folder fsync -> verify

so a kill at any moment leaves either no new file or a complete one that reads back with its
checksum. A sharded checkpoint is written by every rank into `NAME.tmp/` and renamed into place once
committed (sharded.py). A checkpoint at the step about to be saved that does not load is renamed
`NAME.unreadable`, not written over; `.tmp` leftovers of a crashed save are removed by the writer.

One writer per folder: the first write, or a clean-up, locks the folder (lock.py) until `release()`;
a second writer, in this process or another, is refused naming the holder. A folder whose caller
holds its lock already (a training job's output folder) is given that lock and takes none of its own.
A resume file (access.py) is a slot of its own and is written by the same `write_verified`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from exactresume.atomic import TMP_SUFFIX, atomic_write, empty_tmp_folder, fsync_path
from exactresume.errors import CheckpointError, ReadBackError, StorageError, UserError
from exactresume.store.faults import FaultPoints
from exactresume.store.layout import (
    PASSED_OVER,
    UNREADABLE_SUFFIX,
    Layout,
    check_checkpoint,
    is_set_aside,
    set_aside_line,
)
from exactresume.store.locations import Checkpoint
from exactresume.store.lock import FolderLock
from exactresume.store.place import Publishing
from exactresume.store.resume import tensors_in
from exactresume.store.seal_hash import SealError
from exactresume.store.sealed import Serialized, Written, load_sealed, verify, write_sealed
from exactresume.store.writeback import WritingBack
from exactresume.world import World

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

COPY_CHUNK = 8 << 20  # a tier's copy moves this many bytes a read
NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})  # a folder one may read but not write


class DiskFolder:
    """A folder of checkpoints on a disk: listed, written under its lock, read, pruned."""

    def __init__(self, folder: Path, notify: Callable[[str], None], lock: FolderLock | None = None):
        _refuse_a_file_in_the_way(folder)
        self.folder, self.notify = folder, notify
        self.lock, self.owns_lock = lock, lock is None  # a caller's lock on a folder that holds this one

    def hold_lock(self) -> None:
        """Lock the folder for this store's writes (at once if it is free, else UserError); the OSError of a
        lock file that cannot be written, for the write the lock was for to tell (a save, a clean-up)."""
        if self.lock is not None:
            return
        try:
            self.lock = FolderLock.acquire(self.folder)
        except StorageError as refused:
            if isinstance(refused.__cause__, OSError):
                raise refused.__cause__ from None
            raise

    def release(self) -> None:
        if self.lock is not None and self.owns_lock:
            self.lock.release()
            self.lock = None

    def gave_up(self) -> bool:
        return False  # a disk's refusals come at once: a close may try it again

    def _names(self, keep: Callable[[os.DirEntry], bool]) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(self.folder / entry.name for entry in os.scandir(self.folder) if keep(entry))

    def checkpoints(self, layout: Layout) -> list[Checkpoint]:
        """The checkpoints in the folder, oldest step first (names only; nothing is read)."""
        found = ((layout.step_of(path.name), path) for path in self._names(lambda e: e.is_dir() == layout.sharded))
        return sorted((Checkpoint(step, path) for step, path in found if step is not None), key=lambda c: c.step)

    def leftovers(self, layout: Layout) -> list[Path]:
        """`.tmp` files and folders: saves that a crash interrupted before their rename."""
        return self._names(lambda entry: entry.name.endswith(TMP_SUFFIX))

    def set_aside(self) -> list[Path]:
        """Checkpoints a save renamed `NAME.unreadable` rather than write over them: kept, never read."""
        return self._names(lambda entry: is_set_aside(entry.name))

    def remove_leftovers(self, layout: Layout) -> list[Path]:
        """Delete the leftovers of interrupted saves (under the folder's lock); what was removed."""
        if self.folder.is_dir():
            try:
                self.hold_lock()
            except OSError as error:
                raise self._cleaning_refused(error) from error
        removed = self.leftovers(layout)
        for path in removed:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if removed:
            fsync_path(self.folder)
        return removed

    def _cleaning_refused(self, error: OSError) -> StorageError:
        """A load that could not lock the folder to remove leftovers; where this process may not write the
        folder, the reader's way: a load that writes nothing."""
        after = ""
        if error.errno in NOT_WRITABLE:
            after = (
                f"; {self.folder} is not writable, and a reader, which writes nothing there, loads with "
                "store.load(parts, clean=False)"
            )
        return StorageError.from_os_error(f"the lock file of {self.folder}", error, after)

    def unwritable(self, error: OSError) -> str | None:
        """Why no save can succeed here, when `error` says this process may not write the folder."""
        if error.errno not in NOT_WRITABLE:
            return None
        return f"{self.folder} is not writable, so no checkpoint can be saved there: give the store a writable folder"

    # -- writing ----------------------------------------------------------------------------------

    def prepare(self, checkpoint: Checkpoint, layout: Layout, not_ours: bool = False) -> None:
        """Before a checkpoint is written: the folder made and locked, and what is at its name set aside
        unless it loads and is the run's (`not_ours`: a load passed it over): its bytes may matter to someone."""
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)  # another process may make it at the same moment
            fsync_path(self.folder.parent)
        self.hold_lock()
        if layout.sharded:
            empty_tmp_folder(checkpoint.path)  # before the ranks meet and write into it (sharded.py)
        if not checkpoint.path.exists():
            return
        try:
            check_checkpoint(checkpoint, self.read(checkpoint, layout))
            if not_ours:
                raise CheckpointError(PASSED_OVER)
        except CheckpointError as error:
            aside = _free_name(checkpoint.path.with_name(checkpoint.path.name + UNREADABLE_SUFFIX))
            os.replace(checkpoint.path, aside)
            fsync_path(self.folder)
            self.notify(set_aside_line(checkpoint.path, aside.name, str(error)))

    def write_file(self, checkpoint: Checkpoint, state: dict, faults: FaultPoints, publishing: Publishing) -> None:
        """The one-file checkpoint written, durable and verified (module docstring), once `prepare`d."""
        write_verified(checkpoint.path, state, faults, publishing)

    def write_sharded(
        self,
        checkpoint: Checkpoint,
        parts: Mapping[str, Stateful],
        world: World,
        identity: dict | None,
        faults: FaultPoints,
    ) -> None:
        """Every rank writes its shard; rank 0 commits last and reads it back verified (sharded.py)."""
        from exactresume.store.sharded import save_sharded  # DCP takes a second to import: only when used

        save_sharded(checkpoint.path, parts, world, checkpoint.step, identity, faults.reached, staged=True)

    def write_copy(self, checkpoint: Checkpoint, source: BinaryIO) -> None:
        """A verified checkpoint of another tier copied in, byte for byte, by the same stages (once `prepare`d)."""
        atomic_write(checkpoint.path, lambda file: shutil.copyfileobj(source, WritingBack(file), COPY_CHUNK))
        _verify_written(checkpoint.path, FaultPoints())

    # -- reading and pruning ----------------------------------------------------------------------

    def read(self, checkpoint: Checkpoint, layout: Layout) -> Any:
        """The checkpoint's state, its bytes verified first (CheckpointError: they do not verify)."""
        if layout.sharded:
            from exactresume.store.sharded import load_sharded

            return load_sharded(checkpoint.path)
        return load_sealed(checkpoint.path)

    def verifies(self, checkpoint: Checkpoint, layout: Layout) -> bool:
        """Whether the checkpoint's bytes match their checksums (nothing is unpickled); SealError for one
        sealed otherwise than the sealing in force (seal_hash.py), whose bytes may be sound."""
        try:
            if layout.sharded:
                from exactresume.store.sharded import verify_sharded

                verify_sharded(checkpoint.path)
            else:
                verify(checkpoint.path)
        except SealError:
            raise
        except (CheckpointError, OSError):
            return False
        return True

    def delete(self, older: list[Checkpoint], layout: Layout) -> None:
        for checkpoint in older:
            if layout.sharded:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
            else:
                checkpoint.path.unlink(missing_ok=True)
        if older:
            fsync_path(self.folder)


def write_verified(
    path: Path, state: dict, faults: FaultPoints | None = None, publishing: Publishing | None = None
) -> None:
    """Write `state` sealed at `path` (serialize + checksum -> fsync -> rename -> folder fsync), then read it
    back: on any failure no new file remains, and what was at `path` before is left as it was until the
    rename. `publishing` is told just before the rename (if it raises, nothing is published) and once the
    file is durable at `path`, before it is read back."""
    faults, publishing = faults or FaultPoints(), publishing or Publishing()
    reached: list[str] = []

    def stage(name: str) -> None:
        if name == "rename":
            publishing.ready()
        reached.append(name)
        faults.reached(name)

    sealed: list[Written | None] = []  # what write_sealed sealed, which the read-back is held to

    def write(file: BinaryIO) -> None:
        sealed.append(write_sealed(file, state))

    try:
        atomic_write(path, write, stage, expected_bytes=_tensor_bytes(state))
    except BaseException:
        if "folder-fsync" in reached:
            _remove_quietly(path)  # a rename we could not make durable is not a checkpoint
        raise
    publishing.done()
    _verify_written(path, faults, sealed[0])


def _verify_written(path: Path, faults: FaultPoints, sealed: Written | None = None) -> None:
    """Read the new file back and check its checksum (keyed: against what was sealed); a file that fails is removed."""
    try:
        faults.reached("verify")
        verify(path, sealed)
    except OSError:
        _remove_quietly(path)
        raise
    except CheckpointError as error:
        _remove_quietly(path)
        raise ReadBackError(errno.EIO, f"the checkpoint read back damaged ({error})") from None


def _refuse_a_file_in_the_way(folder: Path) -> None:
    """A store whose folder is a file, or lies under one, could never save: refused before it loads as
    empty (a fresh start) and fails only at its first save."""
    for place in (folder, *folder.parents):
        try:  # one look at each: a folder another store is making now is not a file in between
            if stat.S_ISDIR(os.stat(place).st_mode):
                return
        except OSError:  # not there (or under a file): its parent says
            continue
        if place == folder:
            raise UserError(f"{folder} is a file, not a folder of checkpoints: give a folder's path")
        raise UserError(f"{folder} cannot be a folder of checkpoints: {place} is a file, not a folder")


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, Serialized):
        return len(state.view)
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors_in(state))


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
