"""What an `s3://` location holds, told apart as formats.path_kind tells paths, and a verified local copy.

    s3_kind(location)         "file" (an object), "sharded" (a DCP prefix), "folder" (a store's
                              prefix) or "missing": one HEAD and at most one listing
    with local_copy(location) as path:   the committed checkpoint, downloaded and verified

`inspect`, `diff` and `export` read what is on a disk; for an object store they read the local copy
(a file, or a sharded folder with its commit marker), which holds exactly the committed bytes. A
store's prefix is copied as a local store folder holding its newest checkpoint whose commit
verifies, so it reads as `--resume PREFIX` does: that checkpoint, each newer one passed over named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from pathlib import Path

from exactresume.errors import CheckpointError, notice
from exactresume.store.faults import FaultPoints
from exactresume.store.layout import ONE_FILE
from exactresume.store.locations import S3Location
from exactresume.store.resume import check_resume_state
from exactresume.store.s3.client import ObjectStore
from exactresume.store.s3.commit import fetch_committed, read_commit
from exactresume.store.s3.files import fetch_file, load_committed, local_folder
from exactresume.store.seal_hash import SealError

SHARDED_NAMES = ("commit.pth", ".metadata")


def s3_kind(target: S3Location) -> str:
    """What is at `target`, from one HEAD and at most one listing; nothing is downloaded."""
    objects = ObjectStore(target.config)
    if target.key and objects.size(target) is not None:
        return "file"
    names = objects.list(target)
    # Only the prefix's own objects, as is_sharded_folder looks in the folder itself: a store's prefix
    # may hold the sharded resume folder `resume.dcp/` beside its checkpoints.
    if any(name in SHARDED_NAMES or name.endswith(".distcp") for name in names if "/" not in name):
        return "sharded"
    return "folder" if names else "missing"


def read_s3_resume(target: S3Location, needs: Collection[str] = ()) -> dict:
    """The verified resume state of a committed resume file on the store."""
    if s3_kind(target) == "missing":
        raise CheckpointError(f"{target}: no such object or prefix on the object store")
    return check_resume_state(target, load_committed(ObjectStore(target.config), target), needs)


@contextlib.contextmanager
def local_copy(target: S3Location) -> Iterator[Path]:
    """A verified local copy of the committed file or sharded folder at `target` (removed afterwards)."""
    from exactresume.store.sharded import COMMIT, SHARDED_FORMAT, SHARDED_VERSION

    kind, objects = s3_kind(target), ObjectStore(target.config)
    size = objects.size(target) if kind == "file" else sum(objects.list(target).values())
    with local_folder(size or 0) as folder:
        if kind == "file":
            yield fetch_file(objects, target, folder)
        elif kind == "sharded":
            local = folder / (target.name or "bucket")
            local.mkdir()
            commit = read_commit(objects, target / COMMIT, local / COMMIT, SHARDED_FORMAT, SHARDED_VERSION)
            fetch_committed(objects, target, commit, local)
            yield local
        elif kind == "folder":
            yield _newest_copy(objects, target, folder)
        else:
            raise CheckpointError(f"{target}: no such object or prefix on the object store")


def _newest_copy(objects: ObjectStore, prefix: S3Location, folder: Path) -> Path:
    """A local store folder in `folder` holding the newest checkpoint under `prefix` whose objects verify
    against its commit (each newer one passed over is named on stderr, as a resume names it)."""
    from exactresume.store.s3.prefix import S3Prefix

    place = S3Prefix(prefix, notice, FaultPoints())
    local = folder / "checkpoints"  # beside the downloads, never one of their names
    local.mkdir()
    for checkpoint in reversed(place.checkpoints(ONE_FILE)):
        try:
            fetch_file(objects, checkpoint.path, folder).rename(local / checkpoint.path.name)
            return local
        except CheckpointError as error:
            damaged = "" if isinstance(error, SealError) else "damaged "  # another key's may be sound
            notice(f"skipping {damaged}checkpoint {error}")  # as a resume from the prefix says it
    raise CheckpointError(f"{prefix} holds no checkpoint that verifies (step-*.pth)")
