"""Torch files that carry their own checksum, written atomically and verified before unpickling.

A `.pth` file is a zip archive, and a zip archive may end with a comment. We put the xxh3-128
digest of every byte `torch.save` wrote into that comment. The file stays a plain torch file
(`torch.load(path, weights_only=True)` reads it), a single `os.replace` commits file and checksum
together, and a truncated or bit-flipped file is refused before any of its bytes are deserialized.

Speed: the bytes stream through the hash on their way to the file (never assembled in memory), and
zip's per-record CRC-32, which costs about as much as the disk write and which torch.load does not
check, is left out: the seal covers every byte. (A zip tool that checks CRCs, such as Python's
zipfile reading a member, will complain about them; torch.load does not.) Loading opens the file
once, hashes it through a read-only memory map (no copy) and deserializes from the same open file.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.serialization.config as serialization_config
import xxhash

from exactresume.atomic import atomic_write
from exactresume.errors import CheckpointError

SEAL_PREFIX = b"exactresume-xxh3-128:"
SEAL_LENGTH = len(SEAL_PREFIX) + 32  # prefix + 128-bit digest in hex
END_OF_CENTRAL_DIRECTORY = b"PK\x05\x06"
EOCD_SIZE = 22  # the zip end record without its comment; its last two bytes are the comment length


PIECE = 1 << 20  # hashed, then written while still in cache: a tensor's bytes leave memory once


class _HashingWriter:
    """A write-only file that hashes what passes through it (so the bytes are read once)."""

    def __init__(self, file: BinaryIO):
        self.file, self.digest = file, xxhash.xxh3_128()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE):
            piece = view[start : start + PIECE]
            self.digest.update(piece)
            self.file.write(piece)
        return len(view)

    def flush(self) -> None:
        self.file.flush()


def write_sealed(file: BinaryIO, obj: Any) -> None:
    """torch.save `obj` into the seekable `file` and append its checksum as the zip comment."""
    writer = _HashingWriter(file)
    try:
        with serialization_config.patch({"save.compute_crc32": False}):
            torch.save(obj, writer)
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
    """torch.save `obj` to `path` atomically with its checksum in the zip comment."""
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


def load_sealed(path: Path, require_seal: bool = True) -> Any:
    """Verify then load `path` with weights_only=True; unsealed files only if not `require_seal`."""
    path = Path(path)
    try:
        if path.is_dir():
            raise CheckpointError(f"{path} is a folder, not a checkpoint file")
        # One open file for checking and loading: the bytes verified are the bytes loaded, even if
        # another writer replaces `path` meanwhile.
        with open(path, "rb") as file:
            if require_seal or _read_seal(file) is not None:
                _verify(path, file)
            file.seek(0)
            return torch.load(file, weights_only=True, map_location="cpu")
    except OSError as error:
        raise _open_error(path, error) from None
    except CheckpointError:
        raise
    except Exception as error:  # the unpickler's many refusals: bad zip, forbidden global, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: not a loadable torch file ({reason[:200]})") from None
