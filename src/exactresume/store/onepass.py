"""A sealed torch file read once, hashed as it is read, unpickled only once the hash matches its seal.

The one module of ours that uses private torch pieces: torch's own `weights_only` unpickler
(`torch._weights_only_unpickler.Unpickler`, the one `torch.load(weights_only=True)` runs) and
`torch._utils._element_size`. The public way, verifying the file through a memory map and then
`torch.load`, reads every byte twice; this reader reads each once, in order: every storage record
straight into memory of its own (the memory torch.load would allocate for it), hashed while in
cache, the other records (the pickle, torch's version marks) into bytes. The unpickler then builds
the saved object on those storages. What it returns is what torch.load returns.

`load_verified` gives NOT_READ, and sealed.py takes the public way, for a file this reader does not
expect (zip64, compression, not one folder of records, the other byte order) and on a torch whose
private pieces moved: `tests/test_sealed.py` fails that day, since every file we write must be read
here.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from exactresume.errors import CheckpointError
from exactresume.store.seal_hash import mismatch, sealing

try:
    from torch._utils import _element_size
    from torch._weights_only_unpickler import Unpickler
except ImportError:  # a torch that moved them: the public way
    Unpickler = None

NOT_READ = object()  # load_verified's answer for a file it leaves to the public way
PIECE = 1 << 20
CENTRAL_ENTRY = b"PK\x01\x02"
LOCAL_HEADER_SIZE = 30
EOCD_SIZE = 22
ZIP64_MARK = 0xFFFFFFFF  # a size or offset too large for zip's 32 bits: its true value is elsewhere
STORED = 0  # zip's compression method "none", the only one torch.save uses


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable memoryview; the caller keeps the tensor alive.

    Through ctypes rather than `tensor.numpy()`: the library runs where numpy is not installed."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, not one on {tensor.device}")  # never a wild pointer
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass(frozen=True)
class _Entry:
    """One record of the archive, from the central directory: its name under the archive folder."""

    name: str
    offset: int  # of its local header
    size: int


def _central_directory(file: BinaryIO, end: int) -> tuple[int, list[_Entry]] | None:
    """Where the central directory starts and its records in file order; None for a zip we do not expect.

    `end` is where the zip's end record ends (the seal follows it)."""
    file.seek(end - EOCD_SIZE)
    entries, directory_size, start = struct.unpack("<10xHII", file.read(EOCD_SIZE - 2))
    # torch's writer puts zip64's end records between the directory and this one, even in a small file.
    if start + directory_size > end - EOCD_SIZE or ZIP64_MARK in (start, directory_size):
        return None
    file.seek(start)
    directory, found, position = file.read(directory_size), [], 0
    for _ in range(entries):
        if directory[position : position + 4] != CENTRAL_ENTRY:
            return None
        method, compressed, plain, name_length, extra, comment = struct.unpack_from("<10xH8xIIHHH", directory, position)
        offset = struct.unpack_from("<I", directory, position + 42)[0]
        name = directory[position + 46 : position + 46 + name_length].decode("utf-8", errors="replace")
        # A record must lie before the directory: a damaged size is never allocated before the seal is checked.
        if method != STORED or compressed != plain or ZIP64_MARK in (plain, offset) or offset + plain > start:
            return None
        if "/" not in name:
            return None
        found.append(_Entry(name.split("/", 1)[1], offset, plain))
        position += 46 + name_length + extra + comment
    return start, sorted(found, key=lambda entry: entry.offset)


class _HashingReader:
    """The file read once from its start, every byte hashed in order as it arrives."""

    def __init__(self, path: Path, file: BinaryIO):
        self.path, self.file, self.digest, self.position = path, file, sealing().hasher(), 0
        # a keyed MAC hashes the bytes read, which stay as they are, on the other cores while the next are read
        self.hash = self.digest.update_kept if sealing().key is not None else self.digest.update
        file.seek(0)

    def read(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) != count:
            raise CheckpointError(f"{self.path}: the file ends early (it shrank while being read)")
        self.hash(data)
        self.position += count
        return data

    def read_storage(self, count: int) -> torch.Tensor:
        """`count` bytes into new memory of their own (a uint8 tensor), hashed piece by piece while in cache."""
        tensor = torch.empty(count, dtype=torch.uint8)
        view = byte_view(tensor)
        for start in range(0, count, PIECE):
            piece = view[start : start + PIECE]
            done = 0
            while done < len(piece):
                read = self.file.readinto(piece[done:])
                if not read:
                    raise CheckpointError(f"{self.path}: the file ends early (it shrank while being read)")
                done += read
            self.hash(piece)
        self.position += count
        return tensor


class _Records:
    """The records of a torch zip file, already read: small ones as bytes, storages in memory of their own."""

    def __init__(self, records: dict[str, bytes], storages: dict[str, torch.Tensor]):
        self.records, self.storages = records, storages

    def native_byte_order(self) -> bool:
        return self.records.get("byteorder", b"little") == sys.byteorder.encode()

    def storage(self, saved_id: tuple) -> torch.TypedStorage:
        """The storage a pickle's persistent id names, as torch.load's own persistent_load returns it."""
        kind, storage_type, key, _location, numel = saved_id
        if kind != "storage" or f"data/{key}" not in self.storages:
            raise CheckpointError(f"the pickle names a storage {key!r} the file does not hold")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        storage = self.storages[f"data/{key}"].untyped_storage()
        expected = numel * _element_size(dtype)
        if storage.nbytes() != expected:
            raise CheckpointError(f"the record data/{key} holds {storage.nbytes()} bytes, the pickle says {expected}")
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _read_records(path: Path, file: BinaryIO, recorded: str, seal_length: int, size: int | None) -> _Records | None:
    """Every record of the file, read once and verified against the seal; None for a zip we do not expect."""
    size = os.fstat(file.fileno()).st_size if size is None else size
    found = _central_directory(file, size - seal_length)
    if found is None:
        return None
    directory_start, entries = found
    reader, records, storages = _HashingReader(path, file), {}, {}
    for entry in entries:
        if entry.offset < reader.position:
            return None
        reader.read(entry.offset - reader.position)  # a data descriptor between records
        header = reader.read(LOCAL_HEADER_SIZE)
        name_length, extra = struct.unpack_from("<HH", header, 26)
        reader.read(name_length + extra)
        if entry.name.startswith("data/"):
            storages[entry.name] = reader.read_storage(entry.size)
        else:
            records[entry.name] = reader.read(entry.size)
    if directory_start < reader.position:
        return None
    reader.read(size - seal_length - 2 - reader.position)  # the central directory and the end record
    reader.digest.update(b"\x00\x00")  # the comment length as torch.save wrote it
    if not sealing().matches(reader.digest.hexdigest(), recorded):
        raise mismatch(path)
    return _Records(records, storages)


def load_verified(path: Path, file: BinaryIO, recorded: str, seal_length: int, size: int | None = None) -> Any:
    """The object saved in `file` (of `size` bytes: a file-like object without a descriptor gives it),
    whose bytes hash to `recorded`; NOT_READ where the public way must read it."""
    if Unpickler is None:
        return NOT_READ
    records = _read_records(path, file, recorded, seal_length, size)
    if records is None or not records.native_byte_order():
        return NOT_READ
    unpickler = Unpickler(io.BytesIO(records.records["data.pkl"]), encoding="utf-8")
    unpickler.persistent_load = records.storage
    return unpickler.load()
