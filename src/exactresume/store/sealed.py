"""Torch files that carry their own checksum, written atomically and verified before unpickling.

A `.pth` file is a zip archive, and a zip archive may end with a comment. We put the xxh3-128
digest of every byte `torch.save` wrote into that comment (with a key, their HMAC: seal_hash.py).
The file stays a plain torch file (`torch.load(path, weights_only=True)` reads it and gives back
exactly what was saved), a single `os.replace` commits file and checksum together, and a truncated
or bit-flipped file is refused before any of its bytes are deserialized.

Speed: `torch.save` writes each tensor's bytes straight from the state into the file, and zip's
per-record CRC-32, which costs about as much as the disk write and which torch.load does not check,
is left out: the seal covers every byte. (A zip tool that checks CRCs, such as Python's zipfile
reading a member, will complain about them; torch.load does not.) The hash then reads the bytes back
from the page cache, a megabyte at a time into one buffer, while a second thread has the disk take
them (fsync): it costs no time of its own beside the disk's (on an object store, the same bytes are
hashed as they stream into the upload: s3/upload.py). Loading
reads the file once, hashing as it reads (onepass.py), and unpickles only once the digest matches
the seal; where that reader does not apply, the file is verified (`_hash_file`) and then read
by torch.load, from the same open file.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.serialization.config as serialization_config
import xxhash

from exactresume.atomic import atomic_write
from exactresume.errors import CheckpointError, UserError
from exactresume.store.leaves import LeavesAsWritten
from exactresume.store.onepass import NOT_READ, load_verified
from exactresume.store.seal_hash import KEYED_PREFIX, UNKEYED_PREFIX, Hasher, mismatch, refuse_other_sealing, sealing
from exactresume.store.torch_refusal import torch_refusal
from exactresume.store.writeback import WritingBack

SEAL_PREFIXES = (UNKEYED_PREFIX, KEYED_PREFIX)  # the same length: a seal is where it is, keyed or not
SEAL_LENGTH = len(UNKEYED_PREFIX) + 32  # prefix + 128-bit digest in hex
END_OF_CENTRAL_DIRECTORY = b"PK\x05\x06"
ZIP_START = b"PK\x03\x04"  # a zip archive's first record, as torch.save writes it
PICKLE_START = b"\x80"  # a pickle's protocol opcode: how a legacy (pre-zip) torch.save file begins
SEAL_DIGITS = re.compile(rb"[0-9a-f]*")  # what follows the prefix in a seal: the digest in hex
EOCD_SIZE = 22  # the zip end record without its comment; its last two bytes are the comment length
PIECE = 1 << 20  # the hash reads the written file back a megabyte at a time, into one buffer
XXH3 = type(xxhash.xxh3_128())
WRITE_PIECE = 4 << 20  # bytes serialized elsewhere are written four megabytes at a time


class _Flush(threading.Thread):
    """fsync of a file descriptor in a thread of its own (the disk works while this process hashes)."""

    def __init__(self, fd: int):
        super().__init__(name="exactresume-fsync", daemon=True)
        self.fd, self.error = fd, None
        self.start()

    def run(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as error:
            self.error = error

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def _hash_read_back(file: BinaryIO, leaves: LeavesAsWritten | None = None) -> tuple[str, str | None]:
    """The seal's hash of every byte of `file`, read back from the page cache while its bytes go to the
    disk; keyed, the xxh3 of the same bytes too (what a read-back then checks at xxh3's speed), and the
    MAC's pieces `leaves` hashed while the file was written taken as they are."""
    file.flush()
    fd = file.fileno()
    size = os.fstat(fd).st_size
    flush = _Flush(fd)
    try:
        if sealing().key is None:
            return _hash_read(fd, size, xxhash.xxh3_128()).hexdigest(), None
        mac, check = sealing().hasher(), xxhash.xxh3_128()
        start = leaves.into(mac) if leaves is not None else 0
        _hash_file(fd, size, mac, check, first_from=start)  # the MAC's pieces on every core: all at hand in a map
        return mac.hexdigest(), check.hexdigest()
    finally:
        flush.finish()


def _hash_read(fd: int, size: int, digest: Hasher) -> Hasher:
    """`digest` of the file's first `size` bytes, read a megabyte at a time into one buffer.

    Read, not mapped: mapping a file and unmapping it in a training process costs the loop's thread (the
    faults take the process's memory-map lock, which its allocator takes too, and the unmap interrupts
    every core it runs on): a background save every step read back through a map kept 0.957 of the
    steps/s without saving, 0.98 without its file stages, and 0.96-0.99 read (docs/performance.md)."""
    buffer, offset = memoryview(bytearray(PIECE)), 0
    while offset < size:
        count = os.preadv(fd, [buffer[: min(PIECE, size - offset)]], offset)
        if count == 0:
            raise OSError(errno.EIO, "the file being written shrank")
        digest.update(buffer[:count])
        offset += count
    return digest


@dataclass(frozen=True)
class Serialized:
    """What `save_unsealed` writes of a state, made by another process (serializer.py): written as it is."""

    view: memoryview

    def write_to(self, file: BinaryIO) -> None:
        for start in range(0, len(self.view), WRITE_PIECE):  # in pieces: the write's fault point falls halfway
            file.write(self.view[start : start + WRITE_PIECE])


def save_unsealed(obj: Any, file: BinaryIO) -> None:
    """torch.save `obj` into `file` without zip's CRC-32s (the seal covers every byte): what the seal
    is then computed over, ending in a zip comment length of 0."""
    if isinstance(obj, Serialized):
        obj.write_to(file)
        return
    try:
        with serialization_config.patch({"save.compute_crc32": False}):
            torch.save(obj, file)
    except RuntimeError as error:
        # A Ctrl-C inside one of our write calls: torch's zip writer raises its own RuntimeError on
        # the way out ("unexpected pos"); the interrupt is what happened, and what the CLI answers (130).
        if isinstance(error.__context__, KeyboardInterrupt):
            raise error.__context__ from None
        raise


def seal_ending(saved_digest: str) -> bytes:
    """What replaces the last two bytes torch.save wrote: the comment's length, then the seal of those bytes."""
    seal = sealing().prefix + saved_digest.encode()
    return struct.pack("<H", len(seal)) + seal


@dataclass(frozen=True)
class Written:
    """What a keyed write sealed: the MAC recorded, and the xxh3 of the same bytes as they were written."""

    seal: str
    xxh3: str


def write_sealed(file: BinaryIO, obj: Any) -> Written | None:
    """torch.save `obj` into `file` (a real file, open to read and write) and append its checksum as its
    zip comment; its bytes are on the disk when this returns (fsync). Keyed, what it sealed (`verify`
    then reads the file back with the xxh3, not the MAC again); without a key, None."""
    # The disk's writeback started as it goes (the fsync waits less); keyed, the MAC's pieces hashed too
    leaves = LeavesAsWritten(file.fileno()) if sealing().key is not None else None
    save_unsealed(obj, WritingBack(file, leaves.written) if leaves else WritingBack(file))
    seal, check = _hash_read_back(file, leaves)
    file.seek(-2, os.SEEK_END)
    file.write(seal_ending(seal))
    return Written(seal, check) if check is not None else None


def save_sealed(path: Path, obj: Any) -> None:
    """torch.save `obj` to `path` atomically with its checksum in the zip comment."""
    atomic_write(Path(path), lambda file: write_sealed(file, obj))


def _read_seal_record(file: BinaryIO) -> tuple[bytes, str] | None:
    """The seal at the end of `file`: its prefix (which sealing made it) and its digest; None: no seal."""
    size = file.seek(0, os.SEEK_END)
    if size < EOCD_SIZE + SEAL_LENGTH:
        return None
    file.seek(size - EOCD_SIZE - SEAL_LENGTH)
    tail = file.read()
    record, seal = tail[:EOCD_SIZE], tail[EOCD_SIZE:]
    prefix = seal[: len(UNKEYED_PREFIX)]
    if not (record.startswith(END_OF_CENTRAL_DIRECTORY) and prefix in SEAL_PREFIXES):
        return None
    if struct.unpack("<H", record[-2:])[0] != SEAL_LENGTH:
        return None
    return prefix, seal[len(prefix) :].decode("ascii", errors="replace")


def _read_seal(file: BinaryIO) -> str | None:
    found = _read_seal_record(file)
    return None if found is None else found[1]


TAIL_SEARCHED = 1 << 16  # how far back from the end a zip reader looks for the end record


def _tail(file: BinaryIO) -> bytes:
    """The end of the file where a zip reader looks for the end record (with room for a seal after it)."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - TAIL_SEARCHED - EOCD_SIZE - SEAL_LENGTH))
    return file.read()


def _bytes_after_seal(tail: bytes) -> int:
    """How many bytes follow an exactresume seal that is not at the end of `tail` (0: none found)."""
    found = tail.rfind(END_OF_CENTRAL_DIRECTORY)
    while found >= 0:
        record = tail[found : found + EOCD_SIZE + SEAL_LENGTH]
        if len(record) == EOCD_SIZE + SEAL_LENGTH and record[EOCD_SIZE:].startswith(SEAL_PREFIXES):
            return len(tail) - found - EOCD_SIZE - SEAL_LENGTH
        found = tail.rfind(END_OF_CENTRAL_DIRECTORY, 0, found)
    return 0


def _digest(file: BinaryIO, digest: Hasher | None = None) -> str:
    """The seal's hash (or `digest`'s) of the bytes torch.save wrote: the file without its seal, comment
    length as 0."""
    digest = digest or sealing().hasher()
    _hash_file(file.fileno(), os.fstat(file.fileno()).st_size - SEAL_LENGTH - 2, digest)
    digest.update(b"\x00\x00")
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """The seal hash (seal_hash.py) of every byte of the file at `path` (`_hash_file`)."""
    digest = sealing().hasher()
    with open(path, "rb") as file:
        _hash_file(file.fileno(), os.fstat(file.fileno()).st_size, digest)
    return digest.hexdigest()


def _hash_file(fd: int, length: int, *digests: Hasher, first_from: int = 0) -> None:
    """Hash the first `length` bytes of the open file `fd` into each of `digests` (the first from byte
    `first_from` on): an xxh3 alone read in pieces (`_hash_read`), a keyed MAC (which hashes its pieces
    on every core at once) and a keyed write's pair from a memory map, each in one `update`."""
    if length <= 0:
        return
    if len(digests) == 1 and isinstance(digests[0], XXH3) and not first_from:
        _hash_read(fd, length, digests[0])
        return
    # Pages fault in as the hash reads them, with the interpreter lock let go; MAP_POPULATE would map them
    # all in the mmap call, as fast, but holding the lock (~0.5 ms for 20 MB, a background save's cost to the loop).
    with mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
        with memoryview(mapped) as view, view[:length] as hashed, hashed[first_from:] as first:
            # the others (a keyed write's xxh3) at once, in threads: each hash lets go of the GIL
            others = [threading.Thread(target=digest.update, args=(hashed,)) for digest in digests[1:]]
            for thread in others:
                thread.start()
            digests[0].update(first)
            for thread in others:
                thread.join()


def _recorded_seal(path: Path, file: BinaryIO) -> str:
    """The digest the file's seal records, or CheckpointError for an empty, damaged or unsealed file, or
    one sealed otherwise than the sealing in force (keyed, or not)."""
    found = _read_seal_record(file)
    if found is None:
        _refuse_damaged_end(path, file)
        raise CheckpointError(
            f"{path}: no exactresume checksum at the end of the file (truncated, or not written by exactresume)"
        )
    prefix, recorded = found
    refuse_other_sealing(path, prefix)
    return recorded


def _refuse_damaged_end(path: Path, file: BinaryIO) -> None:
    """A file without a seal at its end that is damaged all the same, told from its bytes alone, so that
    every reader, sealed or not, refuses it in the same words: empty, cut short, or appended to."""
    if os.fstat(file.fileno()).st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes)")
    tail = _tail(file)
    cut = _cut_short(tail, file)
    if cut is not None:
        raise CheckpointError(f"{path}: damaged, truncated: {cut}")
    extra = _bytes_after_seal(tail)  # a seal followed by more bytes: appended to after it was sealed
    if extra:
        raise CheckpointError(f"{path}: {extra:,} bytes follow its exactresume checksum: damaged (appended to)")


def _cut_short(tail: bytes, file: BinaryIO) -> str | None:
    """What is missing from the end of a zip archive cut short (None: its end is whole).

    A seal cut short leaves the zip end record whole, and torch.load reads the file still: the record's
    comment length says 53 bytes of seal follow, and fewer do. A longer cut takes the end record itself,
    which every zip archive ends with. `tail` is the file's (_tail)."""
    found = tail.rfind(END_OF_CENTRAL_DIRECTORY)
    if found < 0 or len(tail) - found < EOCD_SIZE:
        file.seek(0)
        return "the end of its zip archive is missing" if file.read(len(ZIP_START)) == ZIP_START else None
    comment = tail[found + EOCD_SIZE :]
    declared = struct.unpack("<H", tail[found + EOCD_SIZE - 2 : found + EOCD_SIZE])[0]
    if declared == SEAL_LENGTH and len(comment) < SEAL_LENGTH and _begins_a_seal(comment):
        return f"its last {SEAL_LENGTH - len(comment)} bytes are missing (of the exactresume checksum at its end)"
    return None


def _begins_a_seal(comment: bytes) -> bool:
    """Whether `comment` is the first bytes of a seal (none at all included)."""
    prefix, digits = comment[: len(UNKEYED_PREFIX)], comment[len(UNKEYED_PREFIX) :]
    return any(whole.startswith(prefix) for whole in SEAL_PREFIXES) and SEAL_DIGITS.fullmatch(digits) is not None


def _verify(path: Path, file: BinaryIO) -> None:
    recorded = _recorded_seal(path, file)
    if not sealing().matches(_digest(file), recorded):
        raise mismatch(path)


def seal_of(file: BinaryIO) -> str | None:
    """The digest recorded at the end of an open sealed file (or a file-like object), or None: no seal,
    or one of another sealing than the one in force (which `load_sealed` names)."""
    found = _read_seal_record(file)
    return found[1] if found is not None and found[0] == sealing().prefix else None


def torch_load_is_wrapped() -> bool:
    """torch.load replaced by a wrapper (the doctor's tracer): it must see every load, so files go through it."""
    return _torch_load_is_wrapped()


def read_seal(path: Path) -> str | None:
    """The digest recorded in the file, or None when the file carries no seal."""
    with open(path, "rb") as file:
        return _read_seal(file)


def verify(path: Path, written: Written | None = None) -> None:
    """Raise CheckpointError unless `path` is sealed and its bytes match the seal. A file just written
    with a key is held to what `write_sealed` sealed: its seal is that MAC, and its bytes hash to the
    xxh3 of the bytes the MAC was computed over (the same proof, at xxh3's speed)."""
    with open(path, "rb") as file:
        if written is None:
            _verify(Path(path), file)
        elif _recorded_seal(path, file) != written.seal or _digest(file, xxhash.xxh3_128()) != written.xxh3:
            raise mismatch(path)


def _torch_load(file: BinaryIO) -> Any:
    file.seek(0)
    return torch.load(file, weights_only=True, map_location="cpu")


def _torch_load_is_wrapped() -> bool:
    """torch.load replaced by a wrapper that records what passes through it (the doctor's tracer, a profiler)."""
    return getattr(torch.load, "__module__", None) != "torch.serialization"


def _load_sealed_file(path: Path, file: BinaryIO) -> Any:
    recorded = _recorded_seal(path, file)
    # A wrapped torch.load is used, so that it sees the load.
    if not _torch_load_is_wrapped():
        loaded = load_verified(path, file, recorded, SEAL_LENGTH)
        if loaded is not NOT_READ:
            return loaded
    _verify(path, file)
    return _torch_load(file)


def load_sealed(path: Path, require_seal: bool = True) -> Any:
    """Verify then load `path` with weights_only=True; unsealed files only if not `require_seal` and no key is set."""
    path = Path(path)
    try:
        if path.is_dir():
            sharded = any(path.glob("*.distcp"))  # DCP's shards: a sharded checkpoint has its own readers
            instead = ": a sharded checkpoint, read by open_resume(folder).restore(parts)" if sharded else ""
            raise CheckpointError(f"{path} is a folder, not a checkpoint file{instead}")
        # One open file for checking and loading: the bytes verified are the bytes loaded, even if
        # another writer replaces `path` meanwhile.
        with open(path, "rb") as file:
            if require_seal or sealing().key is not None or _read_seal(file) is not None:
                return _load_sealed_file(path, file)  # with a key, an unsealed file is refused too
            _refuse_damaged_end(path, file)  # a file without a seal at its end may still have been sealed
            return _torch_load(file)
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror or error}") from None
    except UserError:  # a damaged file, or a key that cannot be (EXACTRESUME_KEY too short)
        raise
    except Exception as error:  # the unpickler's many refusals: bad zip, forbidden global, ...
        try:
            head = first_bytes(path, 8)
        except OSError:
            head = ZIP_START  # unreadable now: torch's own refusal says the rest
        if not head.startswith((ZIP_START[:2], PICKLE_START)):  # text, or bytes of another kind
            raise CheckpointError(
                f"{path}: not a torch file: it begins {head!r}, not as torch.save's zip archive does ({ZIP_START!r})"
            ) from None
        raise CheckpointError(f"{path}: not a loadable torch file ({torch_refusal(error)})") from None


def first_bytes(path: Path, count: int) -> bytes:
    """The first `count` bytes of the file `path`, to say what it is when it is not what it should be."""
    with open(path, "rb") as file:
        return file.read(count)
