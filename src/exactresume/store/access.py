"""One file each way, and one way into any checkpoint, for the training job and for a loop of one's own.

One file: `save_resume(path, parts, step)`, `load_resume(path, parts)` and `read_resume(path)` take a
path or an `s3://` object alike (`sharded=True`: a DCP folder every rank writes its shard of). Under
many processes (`world=`) every rank calls them: the per-rank parts keep every rank's state, and
rank 0 writes the file (every rank its shard, sharded). A run's numbered checkpoints are saved by
its CheckpointStore (numbered.py), whatever its options; a local resume file is written and read
back by the same steps as a store's checkpoint (disk.py).

In: `open_resume(source)` takes a resume file, a checkpoint folder (any CheckpointStore's, whatever
its parts), a sharded DCP folder or "auto" (the newest valid checkpoint in the run's own checkpoint
folder), verifies it and returns its state and step; `Resumed.restore(parts)` loads it into the
parts and returns that step.

    resumed = open_resume("auto", checkpoints="runs/a/checkpoints")   # None: nothing yet, start fresh
    step = resumed.restore(parts) if resumed is not None else 0

Each load given `identity=` (a dict: the seed, the total steps, ...) refuses a state saved by a run
of another identity, or by one that gave none, before any part is loaded; each save given one keeps
it with the state (identity.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from exactresume.errors import CheckpointError, FieldError, StorageError, UserError, notice
from exactresume.store.disk import write_verified
from exactresume.store.formats import is_sharded_folder, path_kind
from exactresume.store.identity import check_identity, refuse_another_run
from exactresume.store.locations import Checkpoint, Location, S3Location, is_s3, location
from exactresume.store.numbered import CheckpointStore, store_reading
from exactresume.store.resume import (
    capture,
    check_parts,
    check_resume_state,
    for_one_file,
    per_rank,
    read_resume_file,
    restore,
    saved_step,
    saved_world_size,
    started_fresh,
)
from exactresume.store.seal_hash import keyed, sealing, sealing_for
from exactresume.world import World, given_world

if TYPE_CHECKING:  # DCP takes a second to import: only when a sharded folder is read
    from torch.distributed.checkpoint.stateful import Stateful

    from exactresume.store.sharded import Destination

__all__ = [
    "AUTO",
    "Resumed",
    "is_sharded_folder",
    "load_resume",
    "open_resume",
    "read_resume",
    "resumed_from",
    "save_resume",
]

AUTO = "auto"  # the newest valid checkpoint in the run's checkpoint folder, or a fresh start


# ---- one file ---------------------------------------------------------------------------------


def save_resume(
    path: Location | str,
    parts: Mapping[str, Stateful],
    step: int | None = None,
    sharded: bool = False,
    world: World | None = None,
    identity: dict | None = None,
    key: str | bytes | None = None,
) -> Location:
    """Write `parts` (saved at `step`, by the run `identity` names) as one resume file, atomically, with
    its checksum (with `key`, or `EXACTRESUME_KEY`, a MAC: seal_hash.py); returns where.

    `path` is a file, or an `s3://` object (committed whole: s3/files.py). Every rank of `world`
    calls it (default: one process; with `sharded`, torchrun's world): rank 0 writes the file, which
    holds every rank's state of the per-rank parts (a load gives each rank its own). With `sharded`,
    a torch.distributed.checkpoint folder instead, of which every rank writes its shard. A write the
    storage refuses is a StorageError, and what was at `path` is left as it was."""
    target = location(path)
    if isinstance(target, Path) and not sharded:
        _check_file_target(path, target)
    world = given_world(world, World.from_env() if sharded else World())
    check_parts(parts)
    identity = check_identity(identity)
    with keyed(sealing_for(key) or sealing()):  # a key in the environment is checked before a byte is written
        if sharded:
            _save_sharded(target, per_rank(parts, world), step, world, identity)
        else:
            one_file = for_one_file(parts, world, "save_resume(folder, parts, step, sharded=True)")
            _save_file(target, one_file, step, world, identity)
    world.barrier()
    return target


def _check_file_target(given: object, target: Path) -> None:
    """UserError for a path that cannot be the file: none given, or a folder."""
    if not target.name:
        raise UserError(f"save_resume: {given!r} names no file: give the resume file's path, e.g. 'resume.pth'")
    if target.is_dir():
        raise UserError(f"save_resume: {target} is a folder: give a file's path in it (sharded=True writes a folder)")


def _save_file(
    target: Location, parts: Mapping[str, Stateful], step: int | None, world: World, identity: dict | None
) -> None:
    if not world.is_main:
        capture(parts, step)  # takes part in gathering the per-rank parts; rank 0 writes
    elif isinstance(target, S3Location):
        from exactresume.store.s3.client import ObjectStore  # boto3: only where an object store is used
        from exactresume.store.s3.files import publish_leased  # under the prefix's lease

        publish_leased(ObjectStore(target.config), target, capture(parts, step, identity))
    else:  # a slot of its own, written and read back as a store's checkpoint is (disk.py)
        try:
            write_verified(target, capture(parts, step, identity))
        except OSError as error:
            raise StorageError.replacing(target, error) from error


def _save_sharded(
    target: Location, parts: Mapping[str, Stateful], step: int | None, world: World, identity: dict | None
) -> None:
    if isinstance(target, S3Location):
        from exactresume.store.s3.sharded import save_sharded_s3  # DCP takes a second to import: only when used

        save_sharded_s3(target, parts, world, step, identity)
        return
    from exactresume.store.sharded import save_sharded

    try:
        save_sharded(target, parts, world, step, identity)
    except OSError as error:
        raise StorageError.replacing(target, error) from error


def read_resume(path: Location | str, needs: Collection[str] = (), key: str | bytes | None = None) -> dict:
    """The verified state of a resume file or `s3://` object (checksum first, then weights_only=True; with
    `key`, or `EXACTRESUME_KEY`, its MAC), restored nowhere; CheckpointError when it is not a complete
    resume state holding `needs`."""
    target = location(path)
    with keyed(sealing_for(key)):
        if isinstance(target, S3Location):
            from exactresume.store.s3.kinds import read_s3_resume

            return read_s3_resume(target, needs)
        return read_resume_file(target, needs)


def load_resume(
    path: Location | str,
    parts: Mapping[str, Stateful],
    skip: Collection[str] = (),
    fresh: Collection[str] = (),
    world: World | None = None,
    identity: dict | None = None,
    key: str | bytes | None = None,
) -> int | None:
    """Verify the resume file (or `s3://` object) at `path` and load it into `parts`, all or nothing
    (`skip` and `fresh` as in resume.restore; each rank of `world`, by default torchrun's, its own
    entry of the per-rank parts; with `identity`, only a file saved by that run; with `key`, or
    `EXACTRESUME_KEY`, only a file sealed with that key's MAC); the step it was saved at (None: saved
    without one)."""
    check_parts(parts)  # a mistake in the call first
    parts = per_rank(parts, given_world(world, World.from_env()))
    identity = check_identity(identity)
    state = read_resume(path, key=key)
    refuse_another_run(state, identity, path)
    for name in restore(state, parts, skip, fresh, source=path):
        notice(started_fresh(path, name))
    return saved_step(state)


# ---- in ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resumed:
    """A verified resume state, the step it continues from, and where it was read."""

    state: dict
    step: int
    path: Location
    kind: str  # "file", "sharded" or "store" (a checkpoint of a CheckpointStore folder)

    @property
    def saved_world_size(self) -> int:
        """How many processes wrote it."""
        return saved_world_size(self.state)

    def restore(
        self,
        parts: Mapping[str, Stateful],
        skip: Collection[str] = (),
        fresh: Collection[str] = (),
        world: World | None = None,
        identity: dict | None = None,
    ) -> int:
        """Load the state into `parts`, all or nothing (`skip` and `fresh` as in resume.restore; the config
        part first: a different run is refused, and with `identity` a state saved by another identity;
        each rank of `world`, by default torchrun's, its own entry of the per-rank parts); the step it
        continues from."""
        check_parts(parts)
        parts = per_rank(parts, given_world(world, World.from_env()))
        refuse_another_run(self.state, check_identity(identity), self.path)
        if self.kind == "sharded":
            from exactresume.store.sharded import sharded_parts  # DCP takes a second to import: only when used

            parts = sharded_parts(parts)
        for name in restore(self.state, parts, skip=skip, fresh=fresh, source=self.path):
            notice(started_fresh(self.path, name))
        return self.step


def open_resume(
    source: Location | str,
    checkpoints: Location | str | None = None,
    needs: Collection[str] = (),
    notify: Callable[[str], None] = notice,
    destination: Destination | None = None,
    key: str | bytes | None = None,
) -> Resumed | None:
    """Verify and read `source`: a resume file, a sharded folder, a checkpoint folder, or AUTO (with `key`,
    or `EXACTRESUME_KEY`, only what that key sealed).

    A checkpoint folder gives its newest checkpoint that verifies (the damaged ones skipped on the way
    are passed to `notify`); one that lacks a part in `needs` is refused, not passed over. AUTO reads
    the folder `checkpoints` (a run's own) the same way, and gives None when it holds no checkpoint:
    a fresh start; when every checkpoint it holds is damaged, it refuses rather than start over them.
    Anything else that is not a complete resume state raises a one-line CheckpointError.
    `destination` tells a sharded folder's reader where this rank's shards go (parallel/fsdp.py).
    """
    with keyed(sealing_for(key)):
        return _open_resume(source, checkpoints, needs, notify, destination)


def _open_resume(
    source: Location | str,
    checkpoints: Location | str | None,
    needs: Collection[str],
    notify: Callable[[str], None],
    destination: Destination | None,
) -> Resumed | None:
    if source == AUTO:
        if checkpoints is None:
            raise FieldError("open_resume('auto') needs the run's checkpoint folder: checkpoints=FOLDER", "checkpoints")
        return _newest_in(location(checkpoints), needs, notify, required=False)
    path = location(source)
    kind = _kind(path)
    if kind == "folder":
        return _newest_in(path, needs, notify, required=True)
    if kind == "sharded":
        state = _read_sharded(path, destination, needs)
        return Resumed(state, _step_of(path, state), path, "sharded")
    state = read_resume(path, needs)  # a missing path, safetensors or any torch file: refused with its reason
    return Resumed(state, _step_of(path, state), path, "file")


def _kind(path: Location) -> str:
    if isinstance(path, S3Location):
        from exactresume.store.s3.kinds import s3_kind

        return s3_kind(path)
    return path_kind(path)


def _read_sharded(path: Location, destination: Destination | None, needs: Collection[str]) -> dict:
    if isinstance(path, S3Location):
        from exactresume.store.s3.sharded import load_sharded_s3

        return load_sharded_s3(path, destination, needs)
    from exactresume.store.sharded import load_sharded

    return load_sharded(path, destination, needs)


def _step_of(path: Path, state: dict) -> int:
    step = saved_step(state)
    if step is None:
        raise CheckpointError(f"{path}: holds no step (neither checkpoint_step nor a step part)")
    return step


def _newest_in(folder: Location, needs: Collection[str], notify, required: bool) -> Resumed | None:
    """The newest valid checkpoint of a store folder; nothing in it is deleted (it may be someone else's)."""
    skipped: list[str] = []
    store = store_reading(folder, skipped.append)
    found = store.load_newest() if required else store.newest_loadable()  # a run's own: never fresh over damage
    if found is None and required:
        what = "uncommitted object(s)" if is_s3(folder) else ".tmp leftover(s)"
        details = [f"only {len(store.leftovers())} {what} of interrupted saves"] if store.leftovers() else []
        details += skipped[:1] + ([f"and {len(skipped) - 1} more passed over"] if len(skipped) > 1 else [])
        raise CheckpointError("; ".join([f"{folder} holds no complete checkpoint", *details]))
    for message in skipped:
        notify(message)
    return None if found is None else resumed_from(store, *found, needs)


def resumed_from(store: CheckpointStore, checkpoint: Checkpoint, state: dict, needs: Collection[str] = ()) -> Resumed:
    """The checkpoint `store` found (its newest_loadable), as a Resumed: refused when it lacks a part in `needs`."""
    kind = "sharded" if store.layout.sharded else "store"
    return Resumed(check_resume_state(checkpoint.path, state, needs), checkpoint.step, checkpoint.path, kind)
