"""DCP's index of a sharded folder (`.metadata`), read without running code from it, and held to the
folder's own files before anything it names is opened or allocated.

DCP reads `.metadata` with plain `pickle`; here it goes through an allow-list of DCP's own record
types, so reading it runs no code. What it says is then checked against what the folder holds: every
file it names is a plain file of the folder that the commit marker lists (no `..`, no absolute path,
no link out of the folder), every chunk lies inside its file, the tensors' bytes are no more than the
files hold, and every path of the nested state is made of names and of list indexes smaller than
the number of items saved. A crafted index is refused with one line, before a byte is allocated
for it.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from exactresume.errors import CheckpointError

# What DCP's .metadata may refer to: its own record types, sizes, dtypes and layouts, and paths.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a DCP index never holds")
        return super().find_class(module, name)


def read_metadata(folder: Path) -> Metadata:
    """DCP's index of a sharded folder, unpickled through an allow-list (so reading it runs no code)."""
    plain_file(Path(folder), ".metadata")
    return parse_index((Path(folder) / ".metadata").read_bytes(), f"{folder}/.metadata")


def parse_index(data: bytes, where: str) -> Metadata:
    """DCP's index from its bytes (`where` names them in an error), through the allow-list."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # unpickling raises many types; all mean the same thing here
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{where} is not a readable DCP index ({reason[:160]})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} is not a DCP index")
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through the allow-list instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def plain_file(folder: Path, name: object) -> Path:
    """`folder/name`, when `name` is the name of a regular file right in `folder` (not a link), else CheckpointError."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{folder}: names {str(name)[:80]!r}, which is not a file name inside the folder")
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        raise CheckpointError(f"{folder}: shard file {name} is missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{folder}: {name} is not a plain file (a link or a folder is never a checkpoint's)")
    return path


def check_index(
    folder: Path, metadata: Metadata, listed: Mapping[str, str], committed_sizes: Mapping[str, int] | None = None
) -> None:
    """Hold the index to the folder: its files are the committed ones, its chunks lie in them, its
    tensors fit in them, its paths are well formed; all before anything is allocated. The files'
    sizes are the folder's, or `committed_sizes` (objects on a store, named by their commit)."""
    sizes: dict[str, int] = dict(committed_sizes or {})
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if name not in listed:
            raise CheckpointError(f"{folder}: its metadata names a file its commit marker does not: {str(name)[:80]!r}")
        if name not in sizes:
            sizes[name] = plain_file(folder, name).stat().st_size
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not (_count(offset) and _count(length) and offset + length <= sizes[name]):
            raise CheckpointError(f"{folder}: the metadata places {getattr(index, 'fqn', '?')} outside {name}")
    tensor_bytes = 0
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensor_bytes += _tensor_bytes(folder, key, item)
    if tensor_bytes > sum(sizes.values()):
        raise CheckpointError(f"{folder}: the metadata's tensors need {tensor_bytes:,} bytes, its files hold fewer")
    _check_paths(folder, metadata)


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _tensor_bytes(folder: Path, key: str, item: TensorStorageMetadata) -> int:
    size = item.size
    if not (isinstance(size, (tuple, list)) and all(_count(dim) for dim in size)):
        raise CheckpointError(f"{folder}: the metadata gives {key} no valid shape")
    dtype = getattr(item.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{folder}: the metadata gives {key} no dtype")
    return math.prod(size) * torch.empty(0, dtype=dtype).element_size()


def _check_paths(folder: Path, metadata: Metadata) -> None:
    """Every path is a tuple of names and list indexes, and no index reaches past the items saved."""
    paths = metadata.planner_data or {}
    if not isinstance(paths, dict):
        raise CheckpointError(f"{folder}: the metadata's paths are not a mapping")
    items = len(metadata.state_dict_metadata)
    for key, path in paths.items():
        well_formed = isinstance(path, tuple) and path and isinstance(path[0], str)
        if not well_formed or not all(isinstance(step, str) or (_count(step) and step < items) for step in path):
            raise CheckpointError(f"{folder}: the metadata's path for {str(key)[:80]!r} is no place in a state")
