"""Torch files that carry their own checksum, written atomically and verified before unpickling.

A `.pth` file is a zip archive, and a zip archive may end with a comment. We put the xxh3-128
digest of every byte `torch.save` wrote into that comment. The file stays a plain torch file
(`torch.load(path, weights_only=True)` reads it), a single `os.replace` commits file and checksum
together, and a truncated or bit-flipped file is refused before any of its bytes are deserialized.

Speed: the bytes stream through the hash on their way to the file (never assembled in memory; a
packed state's tensors are written straight from the state, in place of the placeholders torch.save
was given, see packed.Packing), and zip's per-record CRC-32, which costs about as much as the disk
write and which torch.load does not check, is left out: the seal covers every byte. (A zip tool
that checks CRCs, such as Python's zipfile reading a member, will complain about them; torch.load
does not.) Loading reads the file once, in order, hashing each piece while it is still in cache:
every storage record goes straight into a storage of its own (the memory torch.load would allocate
for it), the other records (the pickle, torch's version marks) into bytes. Only once the digest
matches the seal is the pickle unpickled, by torch's own weights_only unpickler (the one torch.load
uses), its storages the ones already read. A file this reader does not expect (zip64, compression,
not one folder of records) is verified through a read-only memory map and read by torch.load
instead, as is a file written on a machine of the other byte order (torch.load swaps its bytes).
Files in the packed layout (packed.py) come back unpacked: `load_sealed` returns the nested state.
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import torch
import torch.utils.serialization.config as serialization_config
import xxhash
from torch import _weights_only_unpickler

from exactresume.atomic import atomic_write
from exactresume.errors import CheckpointError
from exactresume.store.packed import Packing, unpack

SEAL_PREFIX = b"exactresume-xxh3-128:"
SEAL_LENGTH = len(SEAL_PREFIX) + 32  # prefix + 128-bit digest in hex
END_OF_CENTRAL_DIRECTORY = b"PK\x05\x06"
EOCD_SIZE = 22  # the zip end record without its comment; its last two bytes are the comment length


PIECE = 1 << 20  # hashed, then written while still in cache: a tensor's bytes leave memory once
SMALL_PIECE = PIECE // 4  # a packed piece below this is gathered with its neighbours into one write


class _HashingWriter:
    """A write-only file that hashes what passes through it (so the bytes are read once).

    A write of a placeholder's bytes (packed.Packing: memory torch.save was given but that holds
    nothing) writes the pieces it stands for instead."""

    def __init__(self, file: BinaryIO, packing: Packing | None = None):
        self.file, self.digest = file, xxhash.xxh3_128()
        self.placeholders = [] if packing is None else _placeholders(packing)
        self.gathering = bytearray(PIECE if packing is not None else 0)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        stand_in = self._stand_in(view) if self.placeholders and len(view) else None
        if stand_in is None:
            self._write(view)
        else:
            self._write_pieces(stand_in)
        return len(view)

    def _write_pieces(self, pieces: Iterator[torch.Tensor]) -> None:
        """Large pieces go out as they are; small ones are gathered first, since a system call for
        each of a state's many small tensors costs more than copying them into one warm buffer."""
        gathered, used = memoryview(self.gathering), 0
        for piece in pieces:
            view = memoryview(piece.numpy())
            if used and (len(view) >= SMALL_PIECE or used + len(view) > len(gathered)):
                self._write(gathered[:used])
                used = 0
            if len(view) >= SMALL_PIECE:
                self._write(view)
            else:
                gathered[used : used + len(view)] = view
                used += len(view)
        if used:
            self._write(gathered[:used])

    def _stand_in(self, view: memoryview) -> Iterator[torch.Tensor] | None:
        address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        for start, nbytes, pieces in self.placeholders:
            if address == start and len(view) == nbytes:
                return pieces()
            if start <= address < start + nbytes:  # never seen: torch.save writing a storage in parts
                raise RuntimeError("torch.save wrote part of a packed buffer; the file would not hold the state")
        return None

    def _write(self, view: memoryview) -> None:
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            self.digest.update(piece)
            self.file.write(piece)

    def flush(self) -> None:
        self.file.flush()


def _placeholders(packing: Packing) -> list[tuple[int, int, Callable[[], Iterator[torch.Tensor]]]]:
    return [
        (placeholder.data_ptr(), placeholder.numel(), functools.partial(packing.pieces, index))
        for index, placeholder in enumerate(packing.placeholders)
        if placeholder.numel()
    ]


def write_sealed(file: BinaryIO, obj: Any) -> None:
    """torch.save `obj` (or a Packing's layout) into the seekable `file` and append its checksum as the zip comment."""
    saved, packing = obj, None
    if isinstance(obj, Packing):
        # A torch.save replaced by a wrapper (the doctor's tracer) is given the state itself, in the
        # layout before packing, so that it sees every tensor saved; the file still loads the same.
        saved, packing = (obj.unpacked(), None) if _torch_is_wrapped("save") else (obj.layout, obj)
    writer = _HashingWriter(file, packing)
    try:
        with serialization_config.patch({"save.compute_crc32": False}):
            torch.save(saved, writer)
    except RuntimeError as error:
        # A Ctrl-C inside one of our write calls: torch's zip writer raises its own RuntimeError on
        # the way out ("unexpected pos"); the interrupt is what happened, and what the CLI answers (130).
        if isinstance(error.__context__, KeyboardInterrupt):
            raise error.__context__ from None
        raise
    seal = SEAL_PREFIX + writer.digest.hexdigest().encode()
    file.seek(-2, os.SEEK_END)
    file.write(struct.pack("<H", len(seal)))  # the comment length, then the comment itself
    file.write(seal)


def save_sealed(path: Path, obj: Any) -> None:
    """torch.save `obj` (or a Packing's layout) to `path` atomically with its checksum in the zip comment."""
    atomic_write(Path(path), lambda file: write_sealed(file, obj))


def _read_seal(file: BinaryIO) -> str | None:
    size = file.seek(0, os.SEEK_END)
    if size < EOCD_SIZE + SEAL_LENGTH:
        return None
    file.seek(size - EOCD_SIZE - SEAL_LENGTH)
    tail = file.read()
    record, seal = tail[:EOCD_SIZE], tail[EOCD_SIZE:]
    if not (record.startswith(END_OF_CENTRAL_DIRECTORY) and seal.startswith(SEAL_PREFIX)):
        return None
    if struct.unpack("<H", record[-2:])[0] != SEAL_LENGTH:
        return None
    return seal[len(SEAL_PREFIX) :].decode("ascii", errors="replace")


def _digest(file: BinaryIO) -> str:
    """xxh3-128 of the bytes torch.save wrote: the file without its seal, comment length as 0."""
    digest = xxhash.xxh3_128()
    hashed = os.fstat(file.fileno()).st_size - SEAL_LENGTH - 2
    if hashed > 0:
        populate = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once instead of one fault each
        with mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ) as mapped:
            with memoryview(mapped) as view:
                digest.update(view[:hashed])
    digest.update(b"\x00\x00")
    return digest.hexdigest()


def _verify(path: Path, file: BinaryIO) -> None:
    if os.fstat(file.fileno()).st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes)")
    recorded = _read_seal(file)
    if recorded is None:
        raise CheckpointError(
            f"{path}: no exactresume checksum at the end of the file (truncated, or not written by exactresume)"
        )
    if _digest(file) != recorded:
        raise CheckpointError(f"{path}: checksum mismatch, the file is damaged (modified or partly written)")


def read_seal(path: Path) -> str | None:
    """The digest recorded in the file, or None when the file carries no seal."""
    with open(path, "rb") as file:
        return _read_seal(file)


def verify(path: Path) -> None:
    """Raise CheckpointError unless `path` is sealed and its bytes match the seal."""
    with open(path, "rb") as file:
        _verify(Path(path), file)


def _open_error(path: Path, error: OSError) -> CheckpointError:
    return CheckpointError(f"cannot read {path}: {error.strerror or error}")


CENTRAL_ENTRY = b"PK\x01\x02"
LOCAL_HEADER_SIZE = 30
ZIP64_MARK = 0xFFFFFFFF  # a size or offset too large for zip's 32 bits: its true value is elsewhere
STORED = 0  # zip's compression method "none", the only one torch.save uses


@dataclass(frozen=True)
class _Entry:
    """One record of the archive, from the central directory: its name under the archive folder."""

    name: str
    offset: int  # of its local header
    size: int


def _central_directory(file: BinaryIO, size: int) -> tuple[int, list[_Entry]] | None:
    """Where the central directory starts and its records in file order; None for a zip we do not expect."""
    file.seek(size - SEAL_LENGTH - EOCD_SIZE)
    entries, directory_size, start = struct.unpack("<10xHII", file.read(EOCD_SIZE - 2))
    # torch's writer puts zip64's end records between the directory and this one, even in a small file.
    if start + directory_size > size - SEAL_LENGTH - EOCD_SIZE or ZIP64_MARK in (start, directory_size):
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
        self.path, self.file, self.digest, self.position = path, file, xxhash.xxh3_128(), 0
        file.seek(0)

    def read(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) != count:
            raise CheckpointError(f"{self.path}: the file ends early (it shrank while being read)")
        self.digest.update(data)
        self.position += count
        return data

    def read_storage(self, count: int) -> torch.Tensor:
        """`count` bytes into new memory of their own (a uint8 tensor), hashed piece by piece while in cache."""
        tensor = torch.empty(count, dtype=torch.uint8)
        view = memoryview(tensor.numpy())
        for start in range(0, count, PIECE):
            piece = view[start : start + PIECE]
            done = 0
            while done < len(piece):
                read = self.file.readinto(piece[done:])
                if not read:
                    raise CheckpointError(f"{self.path}: the file ends early (it shrank while being read)")
                done += read
            self.digest.update(piece)
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
        expected = numel * torch._utils._element_size(dtype)
        if storage.nbytes() != expected:
            raise CheckpointError(f"the record data/{key} holds {storage.nbytes()} bytes, the pickle says {expected}")
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _read_verified(path: Path, file: BinaryIO, recorded: str) -> _Records | None:
    """Every record of the file, read once and verified against the seal; None for a zip we do not expect."""
    size = os.fstat(file.fileno()).st_size
    found = _central_directory(file, size)
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
    reader.read(size - SEAL_LENGTH - 2 - reader.position)  # the central directory and the end record
    reader.digest.update(b"\x00\x00")  # the comment length as torch.save wrote it
    if reader.digest.hexdigest() != recorded:
        raise CheckpointError(f"{path}: checksum mismatch, the file is damaged (modified or partly written)")
    return _Records(records, storages)


def _unpickle(records: _Records) -> Any:
    """The pickle's object, unpickled by torch's weights_only unpickler, its storages the ones read."""
    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(records.records["data.pkl"]), encoding="utf-8")
    unpickler.persistent_load = records.storage
    return unpickler.load()


def _torch_is_wrapped(name: str) -> bool:
    """torch.save or torch.load replaced by a wrapper that records what passes through it."""
    return getattr(getattr(torch, name), "__module__", None) != "torch.serialization"


def _load_sealed_file(path: Path, file: BinaryIO) -> Any:
    if os.fstat(file.fileno()).st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes)")
    recorded = _read_seal(file)
    if recorded is None:
        raise CheckpointError(
            f"{path}: no exactresume checksum at the end of the file (truncated, or not written by exactresume)"
        )
    # A torch.load replaced by a wrapper (the doctor's tracer, a profiler) is used, so that it sees the load.
    records = None if _torch_is_wrapped("load") else _read_verified(path, file, recorded)
    if records is not None and records.native_byte_order():
        return unpack(_unpickle(records))
    if records is None:
        _verify(path, file)
    file.seek(0)
    return unpack(torch.load(file, weights_only=True, map_location="cpu"))


def load_sealed(path: Path, require_seal: bool = True) -> Any:
    """Verify then load `path` with weights_only=True, unpacked; unsealed files only if not `require_seal`."""
    path = Path(path)
    try:
        if path.is_dir():
            raise CheckpointError(f"{path} is a folder, not a checkpoint file")
        # One open file for checking and loading: the bytes verified are the bytes loaded, even if
        # another writer replaces `path` meanwhile.
        with open(path, "rb") as file:
            if require_seal or _read_seal(file) is not None:
                return _load_sealed_file(path, file)
            file.seek(0)
            return unpack(torch.load(file, weights_only=True, map_location="cpu"))
    except OSError as error:
        raise _open_error(path, error) from None
    except CheckpointError:
        raise
    except Exception as error:  # the unpickler's many refusals: bad zip, forbidden global, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: not a loadable torch file ({reason[:200]})") from None
