"""Single sealed torch files on an object store: a resume file, a store's checkpoint, read and written.

    publish_sealed(objects, location("s3://b/run/resume.pth"), state)   # object, verified, then commit
    publish_leased(objects, location("s3://b/run/resume.pth"), state)   # the same, under s3://b/run's lease
    state = load_committed(objects, location("s3://b/run/resume.pth"))  # commit, object, seal: verified

The object's bytes are exactly the file save_sealed writes on a disk, so `torch.load` of a downloaded
copy, with nothing of ours imported, gives the lab's dict. torch.save writes it straight into its
upload, sealed at the end (s3/upload.py: no local copy); the stored object is verified, then
committed by its commit object (s3/commit.py). Reading checks size and xxh3 against the commit as
the object streams in, and the seal, before anything is unpickled (s3/stream.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from exactresume.errors import CheckpointError, MissingObject
from exactresume.store.locations import S3Location
from exactresume.store.s3.client import ObjectInfo, ObjectStore, file_info
from exactresume.store.s3.commit import (
    COMMIT_FORMAT,
    COMMIT_VERSION,
    commit_of,
    commit_state,
    fetch_committed,
    read_commit,
    write_commit,
)
from exactresume.store.s3.lease import lease_for
from exactresume.store.s3.upload import SealedUpload, upload_file
from exactresume.store.sealed import load_sealed, save_unsealed

Stage = Callable[[str], None]


SHARED_MEMORY = Path("/dev/shm")
COPY_PREFIX = "exactresume-s3-"  # then the pid of the process that made it, and a random part


@contextlib.contextmanager
def local_folder(needed_bytes: int = 0) -> Iterator[Path]:
    """A private temporary folder for the local copies of objects, removed afterwards: in memory
    (/dev/shm) when it has room for twice `needed_bytes`, for a copy that never waits for a disk.
    The folders a killed process left (its pid is gone) are removed first: in /dev/shm they hold memory."""
    place = None
    with contextlib.suppress(OSError):
        _remove_stale_copies(SHARED_MEMORY)
        free = os.statvfs(SHARED_MEMORY)
        place = SHARED_MEMORY if free.f_bavail * free.f_frsize > 2 * needed_bytes + (64 << 20) else None
    _remove_stale_copies(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{COPY_PREFIX}{os.getpid()}-", dir=place) as folder:
        yield Path(folder)


def _remove_stale_copies(place: Path) -> None:
    """Delete the local-copy folders in `place` whose process no longer exists (a kill -9 mid-save)."""
    for folder in place.glob(f"{COPY_PREFIX}*-*"):
        pid = folder.name[len(COPY_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def state_bytes(state: Any) -> int:
    """The tensor bytes in a nested state (what its torch file about holds)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    return sum(state_bytes(value) for value in state) if isinstance(state, (list, tuple)) else 0


def publish_sealed(
    objects: ObjectStore,
    target: S3Location,
    state: Any,
    stage: Stage = lambda name: None,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """torch.save `state` with its seal straight into an upload to `target` (s3/upload.py), verified, then
    commit it: the old commit is deleted just before the object is replaced, the new one written last.
    `before_publish()` runs before that deletion; if it raises, the upload is aborted."""
    commit = commit_of(target)

    def before_replace() -> None:
        if before_publish is not None:
            before_publish()
        objects.delete([commit])

    upload = SealedUpload(objects, target, before_replace=before_replace)
    stage("write")
    try:
        upload.save(lambda file: save_unsealed(state, file))
        info = upload.finish()
    except BaseException:
        upload.abort()
        raise
    stage("commit")
    write_commit(objects, commit, commit_state({target.name: info}))


def publish_leased(objects: ObjectStore, target: S3Location, state: Any) -> None:
    """publish_sealed under the lease of `target`'s prefix (s3/lease.py), the one its run's checkpoints
    hold: checked before the old commit is deleted and again before the new one is written, so a run
    that lost the prefix to another stops before it changes anything there."""
    with lease_for(objects, target.parent) as lease:

        def stage(name: str) -> None:
            if name == "commit":
                lease.check()

        publish_sealed(objects, target, state, stage, lease.check)


def publish_file(objects: ObjectStore, target: S3Location, path: Path, check: Callable[[], None]) -> None:
    """Upload the local sealed file `path` as it is to `target`, verified, then commit it (as publish_sealed
    does); `check()` (the lease's) runs before the old commit is deleted and before the new one is written."""
    info = file_info(path)
    check()
    commit = commit_of(target)
    objects.delete([commit])
    upload_file(objects, target, path, info)
    check()
    write_commit(objects, commit, commit_state({target.name: info}))


def fetch_file(objects: ObjectStore, source: S3Location, folder: Path) -> Path:
    """Download a committed single-file checkpoint into `folder`, verified against its commit: its local path."""
    commit = read_commit(objects, commit_of(source), folder / "commit", COMMIT_FORMAT, COMMIT_VERSION)
    if list(commit["files"]) != [source.name]:
        raise CheckpointError(f"{commit_of(source)}: commits other objects than {source.name}")
    fetch_committed(objects, source.parent, commit, folder)
    return folder / source.name


def load_committed(objects: ObjectStore, source: S3Location, size: int | None = None) -> Any:
    """The verified contents of a committed sealed file on the store (weights_only, as load_sealed):
    streamed in as it arrives (s3/stream.py), or where that does not apply downloaded and loaded."""
    from exactresume.store.s3.stream import NOT_STREAMED, load_streamed

    with local_folder(size if size is not None else objects.size(source) or 0) as folder:
        commit = read_commit(objects, commit_of(source), folder / "commit", COMMIT_FORMAT, COMMIT_VERSION)
        if list(commit["files"]) != [source.name]:
            raise CheckpointError(f"{commit_of(source)}: commits other objects than {source.name}")
        expected = ObjectInfo(commit["bytes"][source.name], commit["files"][source.name])
        try:
            loaded = load_streamed(objects, source, expected)
        except MissingObject:
            raise CheckpointError(f"{source} is missing, though its commit names it") from None
        if loaded is not NOT_STREAMED:
            return loaded
        fetch_committed(objects, source.parent, commit, folder)
        local = folder / source.name
        try:
            return load_sealed(local)
        except CheckpointError as error:
            raise type(error)(str(error).replace(str(local), str(source))) from None
