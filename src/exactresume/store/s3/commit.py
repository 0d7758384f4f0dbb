"""Committing without a rename: every object written and verified first, then one commit object.

An object store has no atomic rename (DCP's fsspec writer "renames" its `.metadata` into place, which
on S3 is a copy and a delete). Here a checkpoint is committed by the last object written:

    step-00000030.pth           the checkpoint itself, one sealed torch file (a PUT is all or nothing)
    step-00000030.pth.commit    {"format", "version", "files": {name: xxh3}, "bytes": {name: size}}
    resume.dcp/__0_0.distcp ... a DCP folder's objects, each rank's own
    resume.dcp/commit.pth       the sharded commit marker (sharded.py's), with every object's size too

The commit object is itself a sealed torch file (torch.load reads it as a plain dict). It is written
only once every object it names was uploaded and the server's checksum and size matched, so a reader
that finds it can demand exactly those bytes: it downloads each object, hashing as it writes, and
trusts the checkpoint only when every size and xxh3 agree. A save that dies at any point leaves an
old commit deleted or a new one not yet written: nothing a reader trusts, nothing it mistakes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

from exactresume.errors import CheckpointError, MissingObject
from exactresume.store.formats import check_format
from exactresume.store.locations import S3Location
from exactresume.store.s3.client import ObjectInfo, ObjectStore
from exactresume.store.sealed import load_sealed, save_sealed

COMMIT_FORMAT = "exactresume.s3-commit"
COMMIT_VERSION = 1
COMMIT_SUFFIX = ".commit"  # beside a single-file checkpoint: NAME.commit


def commit_of(target: S3Location) -> S3Location:
    """Where a single-file checkpoint's commit object lives."""
    return target.with_name(target.name + COMMIT_SUFFIX)


def commit_state(objects: Mapping[str, ObjectInfo], header: Mapping | None = None) -> dict:
    """The commit's dict: every object's xxh3 and size by name (`header` gives its format and version)."""
    names = sorted(objects)
    header = header or {"format": COMMIT_FORMAT, "version": COMMIT_VERSION}
    return dict(header) | {
        "files": {name: objects[name].digest for name in names},
        "bytes": {name: objects[name].size for name in names},
    }


def write_commit(store: ObjectStore, at: S3Location, state: dict) -> None:
    """Upload the commit object `state` to `at`, sealed, verified as every object is."""
    with tempfile.TemporaryDirectory(prefix="exactresume-s3-") as folder:
        local = Path(folder) / at.name
        save_sealed(local, state)
        store.put_bytes(at, local.read_bytes())  # one small PUT (not an "upload" fault point: its own stage)


def read_commit(store: ObjectStore, at: S3Location, into: Path, format: str, version: int) -> dict:
    """The commit object at `at`, downloaded to `into`, checked: CheckpointError when missing or damaged."""
    try:
        store.download(at, into)
    except MissingObject:
        raise CheckpointError(f"{at} is missing: the checkpoint was never committed, so it is not trusted") from None
    try:
        state = check_format(at, load_sealed(into), format, version, "an exactresume commit object")
    except CheckpointError as error:
        raise type(error)(str(error).replace(str(into), str(at))) from None
    files, sizes = state.get("files"), state.get("bytes")
    if not (isinstance(files, dict) and isinstance(sizes, dict) and files and files.keys() == sizes.keys()):
        raise CheckpointError(f"{at}: a commit object that names no objects, or not each with its size")
    for name in files:
        _check_name(at, name)
    return state


def _check_name(at: S3Location, name: object) -> str:
    """A name a commit may list: one plain name under its prefix (no '/', '..' or empty name)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{at}: names {str(name)[:80]!r}, which is not an object of the checkpoint")
    return name


def fetch_committed(store: ObjectStore, folder: S3Location, commit: dict, into: Path) -> None:
    """Download every object `commit` names under `folder` into the local folder `into`, each verified."""
    for name, digest in commit["files"].items():
        size = commit["bytes"][name]
        if not isinstance(size, int) or not isinstance(digest, str):
            raise CheckpointError(f"{folder}: its commit gives {name} no size or checksum")
        try:
            store.get_file(folder / name, into / name, ObjectInfo(size, digest))
        except MissingObject:
            raise CheckpointError(f"{folder / name} is missing, though its commit names it") from None
