"""What an `s3://` location holds, told apart as formats.path_kind tells paths, and a verified local copy.

    s3_kind(location)         "file" (an object), "sharded" (a DCP prefix), "folder" (a store's
                              prefix) or "missing": one HEAD and at most one listing
    with local_copy(location) as path:   the committed checkpoint, downloaded and verified

`inspect`, `diff` and `export` read what is on a disk; for an object store they read the local copy
(a file, or a sharded folder with its commit marker), which holds exactly the committed bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from pathlib import Path

from exactresume.errors import CheckpointError
from exactresume.store.locations import S3Location
from exactresume.store.resume import check_resume_state
from exactresume.store.s3 import ObjectStore
from exactresume.store.s3_commit import fetch_committed, read_commit
from exactresume.store.s3_files import fetch_file, load_committed, local_folder

SHARDED_NAMES = ("commit.pth", ".metadata")


def s3_kind(target: S3Location) -> str:
    """What is at `target`, from one HEAD and at most one listing; nothing is downloaded."""
    objects = ObjectStore(target.config)
    if target.key and objects.size(target) is not None:
        return "file"
    names = objects.list(target)
    if any(name in SHARDED_NAMES or name.endswith(".distcp") for name in names):
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
            raise CheckpointError(f"{target} is a prefix of checkpoints, not one checkpoint: name one object")
        else:
            raise CheckpointError(f"{target}: no such object or prefix on the object store")
