"""Sharded resume checkpoints through torch.distributed.checkpoint (DCP): every rank writes its shard.

`--sharded` writes the resume state as a folder NAME (`resume.dcp`) holding

    __0_0.distcp, __1_0.distcp, ...   the shards (DCP spreads the replicated tensors over the ranks)
    .metadata                         DCP's index of every item, written by rank 0 once all shards are in
    commit.pth                        the commit marker: xxh3-128 of every file above, written last

It is written as NAME.tmp/ and renamed to NAME only once committed, so a rank killed mid-save
leaves the previous NAME as it was; a folder without its commit marker is never trusted, and every
file's checksum is checked before DCP reads it. DCP itself reads `.metadata` with `pickle` and
non-tensor values with `torch.load(weights_only=False)`; here both go through allow-lists, so
loading never runs code from a file. A replicated model (DDP) loads the whole checkpoint on each
rank: any number of processes can resume it, one included, without a process group. A sharded
model (FSDP2) names a `destination` for its weights and their optimizer moments, a DTensor laid out
as this run shards them, and DCP reads only this rank's rows from whatever layout was saved.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from exactresume.atomic import empty_tmp_folder, fsync_path, replace_folder, tmp_path
from exactresume.errors import CheckpointError
from exactresume.store.collector import older_objects_frozen
from exactresume.store.containers import CONTAINERS_KEY, parent_made, record_containers, restore_containers, slot
from exactresume.store.dcp_index import VerifiedReader, check_index, plain_file
from exactresume.store.dcp_writer import HashingWriter
from exactresume.store.formats import check_format
from exactresume.store.layout import COMMIT
from exactresume.store.resume import capture, check_resume_state, is_dtensor, tensors_in
from exactresume.store.save_plans import planner_for
from exactresume.store.seal_hash import sealing
from exactresume.store.sealed import file_digest, load_sealed, save_sealed
from exactresume.world import World

SHARDED_FORMAT = "exactresume.sharded"
SHARDED_VERSION = 1


class OptimizerByName:
    """The optimizer part keyed by parameter names, DCP's layout (torch's own keys are indices)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        # On a fresh optimizer this first takes one step with lr 0 and zero gradients to create its
        # state (torch's _init_optim_state): AdamW leaves every weight bit-identical, then the
        # loaded state replaces the one it made.
        whole = StateDictOptions(full_state_dict=_whole_into_shards(self.model, state))
        set_optimizer_state_dict(self.model, self.optimizer, state, options=whole)


class ShardedModule:
    """A module sharded over the ranks (FSDP2's DTensors) as a part: a state read whole (no
    `destination` named each rank's rows) is laid out as the module is sharded now, each rank keeping
    its own rows."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @property
    def sharded_module(self) -> torch.nn.Module:
        """The module itself, whose tensors a saved state must fit (fit.py)."""
        return self.module

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if _whole_into_shards(self.module, state):
            set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))
        else:  # read into this rank's rows already
            self.module.load_state_dict(state)


def _whole_into_shards(module: torch.nn.Module, state: Any) -> bool:
    """Whether `state` holds whole tensors for a module whose parameters are DTensors."""
    if not any(is_dtensor(parameter) for parameter in module.parameters()):
        return False
    return not any(is_dtensor(value) for value in tensors_in(state))


class MarkedScaler:
    """The scaler part with a key that is always there: DCP stores nothing for an empty dict, which is
    the GradScaler's state in fp32 and bf16, and the part would then be missing when loaded."""

    def __init__(self, scaler: Stateful):
        self.scaler = scaler

    def state_dict(self) -> dict:
        return {SCALER_MARK: True} | self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict({key: value for key, value in state.items() if key != SCALER_MARK})


SCALER_MARK = "saved"


def sharded_parts(parts: Mapping[str, Stateful]) -> dict[str, Stateful]:
    """`parts` as a sharded checkpoint holds them: each optimizer keyed by the names of the parameters
    of the module part it optimizes (whatever the parts are called), a module sharded over the ranks
    loaded through torch's own state-dict calls, the scaler marked."""
    wrapped: dict[str, Stateful] = {}
    for name, part in parts.items():
        model = _module_of(part, parts) if isinstance(part, torch.optim.Optimizer) else None
        if model is not None:
            wrapped[name] = OptimizerByName(model, part)
        elif isinstance(part, torch.nn.Module) and any(map(is_dtensor, part.parameters())):
            wrapped[name] = ShardedModule(part)
    if "scaler" in parts:
        wrapped["scaler"] = MarkedScaler(parts["scaler"])
    return dict(parts) | wrapped


def _module_of(optimizer: torch.optim.Optimizer, parts: Mapping[str, Stateful]) -> torch.nn.Module | None:
    """The module part whose parameters `optimizer` steps, if one of the parts is."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for part in parts.values():
        if isinstance(part, torch.nn.Module) and stepped <= {id(p) for p in part.parameters()}:
            return part
    return None


# ---- saving -----------------------------------------------------------------------------------


def save_sharded(
    folder: Path,
    parts: Mapping[str, Stateful],
    world: World,
    step: int | None = None,
    identity: dict | None = None,
    stage: Callable[[str], None] = lambda name: None,
    staged: bool = False,
) -> None:
    """Every rank writes its shard (saved at `step`, by the run `identity` names) into FOLDER.tmp/,
    hashed as it is written, and reads its own files back verified (the ranks hash at once, on their
    own cores); rank 0 then commits their checksums and puts the folder at `folder`. Rank 0 empties
    FOLDER.tmp/ first, unless `staged` says it did (`empty_tmp_folder`, in a store's prepare), and no rank
    writes before it has. `stage(name)` is called at each stage, a fault-injection point
    (store/faults.py): "write" on every rank, then on rank 0 "fsync" (every shard is durable and
    verified, the commit not yet written), "rename", "folder-fsync" and "verify" (the commit marker
    read back)."""
    with older_objects_frozen():
        _save_sharded(folder, parts, world, step, identity, stage, staged)


def sharded_state(parts: Mapping[str, Stateful], step: int | None, identity: dict | None) -> dict:
    """The resume state a sharded checkpoint holds: the parts' (as `sharded_parts` takes them), and the
    record of what DCP's names forget of its containers (containers.py)."""
    state = capture(sharded_parts(parts), step, identity)
    return state | {CONTAINERS_KEY: record_containers(state)}


def _save_sharded(folder, parts, world, step, identity, stage, staged) -> None:
    staging = tmp_path(folder)
    state = sharded_state(parts, step, identity)
    if world.is_main and not staged:
        empty_tmp_folder(folder)
    planner = planner_for(state, world)  # a collective: no rank writes before rank 0 has emptied FOLDER.tmp/
    stage("write")
    writer = HashingWriter(staging, sealing())  # each shard and the index fsynced before DCP returns
    with quiet_single_process(), first_failure():
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=world.size == 1)
    # dcp.save returns once every rank's shard and the index are written: one exchange after it, not barriers
    hashed = world.gather(_read_back(staging, writer.digests, world))
    damaged = [name for _, names in hashed for name in names]
    if damaged:  # on every rank, so that none waits for the others
        raise CheckpointError(f"{folder}: {damaged[0]} read back damaged (checksum mismatch): not committed")
    if world.is_main:
        stage("fsync")
        write_commit(staging, world.size, step, {name: digest for files, _ in hashed for name, digest in files.items()})
        stage("rename")
        replace_folder(staging, folder)
        stage("folder-fsync")
        stage("verify")
        _commit_marker(folder / COMMIT)


def _read_back(staging: Path, digests: Mapping[str, str], world: World) -> tuple[dict[str, str], list[str]]:
    """The checksums of the files this rank wrote, as they were written, and those whose bytes read back differ."""
    own = {path.name: digests.get(path.name) or file_digest(path) for path in _own_files(staging, world)}
    return own, [name for name, digest in own.items() if not sealing().matches(file_digest(staging / name), digest)]


def _own_files(staging: Path, world: World) -> list[Path]:
    """The files of a DCP folder this rank wrote (`__RANK_N.distcp`); rank 0 also hashes the rest (the index)."""
    owners = {path: _writer_of(path.name, world.size) for path in sorted(staging.iterdir()) if path.is_file()}
    return [path for path, owner in owners.items() if owner == world.rank]


def _writer_of(name: str, processes: int) -> int:
    found = re.match(r"__(\d+)_\d+\.distcp$", name)
    return int(found.group(1)) if found and int(found.group(1)) < processes else 0


def write_commit(staging: Path, processes: int, step: int | None = None, files: dict[str, str] | None = None) -> None:
    """The commit marker: the checksum of every file DCP wrote (`files`, by default hashed here), itself
    sealed; written last. It also holds the step, so that `inspect` can say it without reading DCP's objects."""
    if files is None:
        files = {p.name: file_digest(p) for p in sorted(staging.iterdir()) if p.is_file()}
    sizes = {name: (staging / name).stat().st_size for name in files}  # a cut or grown file is named so
    marker = {"format": SHARDED_FORMAT, "version": SHARDED_VERSION, "processes": processes}
    marker |= {"files": files, "bytes": sizes}
    save_sealed(staging / COMMIT, marker | ({"step": step} if step is not None else {}))
    fsync_path(staging)


@contextlib.contextmanager
def first_failure() -> Iterator[None]:
    """Raise the exception a DCP call met itself, not its CheckpointException (a BaseException) around it."""
    try:
        yield
    except CheckpointException as error:
        raise next(iter(error.failures.values()))[0] from None


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process: that is what we mean.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---- loading ----------------------------------------------------------------------------------


def verify_sharded(folder: Path) -> dict:
    """The commit marker, after checking that every file it lists is present with its checksum."""
    commit = folder / COMMIT
    if not commit.is_file():
        if not any(folder.glob("*.distcp")):
            raise CheckpointError(f"{folder} is a folder, not a resume file or a sharded checkpoint")
        raise CheckpointError(f"{folder}: no commit marker ({COMMIT}): its save did not finish, so it is not trusted")
    plain_file(folder, COMMIT)
    marker = _commit_marker(commit)
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{commit}: lists no files, or not DCP's index (.metadata)")
    sizes = marker.get("bytes", {})  # absent from a marker written before sizes were recorded
    for name, digest in files.items():
        path = plain_file(folder, name)
        _check_size(folder, name, path.stat().st_size, sizes.get(name))
        if not sealing().matches(file_digest(path), digest):
            raise CheckpointError(f"{folder}: {name} is damaged (checksum mismatch)")
    return marker


def _check_size(folder: Path, name: str, size: int, recorded: object) -> None:
    if isinstance(recorded, int) and size != recorded:
        what = "truncated" if size < recorded else "appended to"
        raise CheckpointError(
            f"{folder}: {name} is damaged, {what}: it holds {size:,} bytes, its commit marker says {recorded:,}"
        )


def _commit_marker(commit: Path) -> dict:
    """The commit marker at `commit`, verified and of this format: what a save reads back and a load trusts."""
    return check_format(commit, load_sealed(commit), SHARDED_FORMAT, SHARDED_VERSION, "an exactresume commit marker")


# (the saved item's path in the nested state, its shape) -> the tensor to read it into, or None: whole.
Destination = Callable[[tuple, torch.Size], torch.Tensor | None]


def load_sharded(folder: Path, destination: Destination | None = None, needs: Collection[str] = ()) -> dict:
    """Verify, then read the sharded checkpoint into a resume state dict (as load_resume returns).

    Each tensor is read whole into a new tensor, or into what `destination` gives for it.
    """
    folder = Path(folder)
    marker = verify_sharded(folder)
    return read_verified(folder, VerifiedReader(folder), marker["files"], destination, needs)


def read_verified(
    folder: Path,
    reader: VerifiedReader,
    listed: Mapping[str, str],
    destination: Destination | None,
    needs: Collection[str],
    sizes: Mapping[str, int] | None = None,
) -> dict:
    """The state DCP reads through `reader` from a folder whose commit (listing `listed`) was verified;
    `sizes` are the committed objects' when they are on a store, read by range (s3/ranges.py)."""
    metadata = reader.read_metadata()
    check_index(folder, metadata, listed, sizes)  # before a byte is allocated for what it names
    try:
        paths = metadata.planner_data or {}
        saved = metadata.state_dict_metadata.items()
        flat = {key: _target(item, paths.get(key, (key,)), destination) for key, item in saved}
        with quiet_single_process(), first_failure():
            dcp.load(flat, storage_reader=reader, planner=_SafeLoadPlanner(folder), no_dist=True)
        state = _unflatten(flat, paths)
        state = restore_containers(state, state.pop(CONTAINERS_KEY, None))
    except CheckpointError:
        raise
    except Exception as error:  # DCP's many refusals of an inconsistent folder
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{folder}: not a loadable sharded checkpoint ({reason[:200]})") from None
    return check_resume_state(folder, state, needs)


def _target(item: Any, path: tuple, destination: Destination | None) -> Any:
    """What DCP reads a saved item into: a tensor of its shape (`destination`'s, or a new one); None for a value."""
    if not isinstance(item, TensorStorageMetadata):
        return None  # a value DCP unpickles
    chosen = destination(path, item.size) if destination is not None else None
    if chosen is not None and chosen.dtype == item.properties.dtype:
        return chosen
    return torch.empty(item.size, dtype=item.properties.dtype)


def _unflatten(flat: Mapping[str, Any], paths: Mapping[str, tuple]) -> dict:
    """DCP's flat keys back into the nested dict they were saved from (a list where a step is an index)."""
    nested: dict = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        slot(parent_made(nested, path), path[-1], value, replace=True)
    return nested


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner for a flat dict of every saved key, unpickling values with weights_only=True."""

    def __init__(self, folder: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.folder = folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            named = re.search(r"GLOBAL (\S+)", str(error))
            why = f"it refers to {named.group(1)}" if named else str(error).splitlines()[0][:120]
            fqn = read_item.dest_index.fqn
            raise CheckpointError(f"{self.folder}: value {fqn} is not plain data ({why})") from None
