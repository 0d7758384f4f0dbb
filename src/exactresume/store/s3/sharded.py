"""Sharded (DCP) resume checkpoints under an `s3://` prefix: each rank uploads its own objects.

    s3://bucket/run/checkpoints/resume.dcp/__0_0.distcp, __1_0.distcp, .metadata, commit.pth

Every rank has DCP write its shard into a private local folder, uploads those files and verifies
them (the server's checksum and size); the ranks then hand rank 0 each object's size and xxh3, and
rank 0 writes the commit object last (`commit.pth`, sharded.py's marker with the sizes added), once
every rank has finished: the barrier, then the commit, as a local sharded folder is renamed into
place. Rank 0 writes under the prefix's lease (s3/lease.py: the one its run's checkpoints hold),
checked before the old commit is deleted and before the new one is written. The previous commit is
deleted before any shard is replaced, so a save killed on any rank leaves a prefix no reader trusts;
objects that the new commit does not name (an earlier run's extra ranks) are deleted after it. A
reader downloads the committed objects, each checked against the commit as it is written, and reads
the local copy as sharded.py reads a folder (every check again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from exactresume.errors import CheckpointError, StorageError, UserError
from exactresume.store.dcp_index import parse_index
from exactresume.store.locations import S3Location
from exactresume.store.s3.client import ObjectStore, file_info
from exactresume.store.s3.commit import commit_state, fetch_committed, read_commit, write_commit
from exactresume.store.s3.files import local_folder, state_bytes
from exactresume.store.s3.lease import S3Lease, lease_for
from exactresume.store.s3.ranges import RANGES_KEY, item_ranges, ranged_reader
from exactresume.store.s3.upload import upload_file
from exactresume.store.save_plans import planner_for
from exactresume.store.sharded import (
    COMMIT,
    SHARDED_FORMAT,
    SHARDED_VERSION,
    Destination,
    first_failure,
    quiet_single_process,
    read_verified,
    sharded_state,
)
from exactresume.world import World


def save_sharded_s3(
    target: S3Location,
    parts: Mapping[str, Stateful],
    world: World,
    step: int | None = None,
    identity: dict | None = None,
    objects: ObjectStore | None = None,
    stage: Callable[[str], None] = lambda name: None,
) -> None:
    """Every rank writes and uploads its shard (saved at `step`, by the run `identity` names); rank 0
    commits once all have, under the lease of the folder's prefix (s3/lease.py), checked before the old
    commit goes and the new one is written. `stage(name)` is called at "write" (every rank) and at
    "commit" (rank 0), fault-injection points (store/faults.py), as `objects`' own before each part."""
    import torch.distributed.checkpoint as dcp

    objects = objects or ObjectStore(target.config)
    state = sharded_state(parts, step, identity)
    with contextlib.ExitStack() as held:
        lease = _unpublish(objects, target, world, held)  # from here until the new commit, the prefix is not trusted
        with local_folder(state_bytes(state) // world.size) as staging:
            planner = planner_for(state, world)
            stage("write")
            writer = FileSystemWriter(staging, sync_files=False)
            with quiet_single_process(), first_failure():
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=world.size == 1)
            index = world.gather((staging / ".metadata").read_bytes() if world.is_main else None)[0]  # rank 0's
            uploaded, failure = _upload_own(objects, target, staging, parse_index(index, f"{target}/.metadata"))
        everyone = world.gather(uploaded)
        if failure is not None:
            raise failure
        if None in everyone:
            raise StorageError(f"another rank could not upload its shard of {target}; it is not committed")
        if world.is_main:
            stage("commit")
            lease.check()
            objects_of_all = {name: info for mine, _ in everyone for name, info in mine.items()}
            ranges = {name: items for _, theirs in everyone for name, items in theirs.items()}
            header = {"format": SHARDED_FORMAT, "version": SHARDED_VERSION, "processes": world.size}
            write_commit(objects, target / COMMIT, commit_state(objects_of_all, header) | {RANGES_KEY: ranges})
            stale = set(objects.list(target)) - set(objects_of_all) - {COMMIT}
            objects.delete([target / name for name in sorted(stale)])
    world.barrier()


def _unpublish(objects: ObjectStore, target: S3Location, world: World, held: contextlib.ExitStack) -> S3Lease | None:
    """Rank 0 takes (or finds) the prefix's lease, checks it and deletes the folder's commit; every rank
    learns whether it could, so that none uploads over a prefix this run may not write, nor waits for it."""
    lease, refused = None, None
    if world.is_main:
        try:
            lease = held.enter_context(lease_for(objects, target.parent))
            lease.check()
            objects.delete([target / COMMIT])
        except (UserError, StorageError) as error:
            refused = error
    told = world.gather(None if refused is None else (isinstance(refused, StorageError), str(refused)))[0]
    if told is not None:  # every rank stops with rank 0's line (and its exit code)
        raise refused or (StorageError if told[0] else UserError)(told[1])
    return lease


def _upload_own(
    objects: ObjectStore, target: S3Location, staging: Path, index: Metadata
) -> tuple[tuple | None, Exception | None]:
    """Upload this rank's files: their infos and their items' ranges, or None and the error (raised
    once every rank has reported, so that no rank waits for one that failed)."""
    try:
        mine = {path.name: file_info(path) for path in sorted(staging.iterdir()) if path.is_file()}
        for name, info in mine.items():
            upload_file(objects, target / name, staging / name, info)
        return (mine, item_ranges(staging, index, set(mine))), None
    except (OSError, StorageError) as error:
        return None, error


def load_sharded_s3(target: S3Location, destination: Destination | None = None, needs: Collection[str] = ()) -> dict:
    """Verify and read a committed sharded checkpoint on the store (as sharded.load_sharded reads a folder)."""
    objects = ObjectStore(target.config)
    with local_folder() as folder:
        commit = read_commit(objects, target / COMMIT, folder / COMMIT, SHARDED_FORMAT, SHARDED_VERSION)
        try:
            if ".metadata" not in commit["files"]:
                raise CheckpointError(f"{target / COMMIT}: lists no files, or not DCP's index (.metadata)")
            only_index = {key: {".metadata": commit[key][".metadata"]} for key in ("files", "bytes")}
            fetch_committed(objects, target, only_index, folder)
            reader = ranged_reader(objects, target, folder, commit)  # the shards' items, each by one ranged GET
            return read_verified(folder, reader, commit["files"], destination, needs, commit["bytes"])
        except CheckpointError as error:
            raise type(error)(str(error).replace(str(folder), str(target))) from None
