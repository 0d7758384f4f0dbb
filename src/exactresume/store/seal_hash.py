"""The hash that every seal and checksum of ours records: xxh3-128, or HMAC-SHA-256 with a key.

Without a key a seal catches damage (a torn write, a flipped bit, a truncated upload), not tampering:
anyone who can write a checkpoint can recompute its xxh3. With a key (`EXACTRESUME_KEY`, or `key=`
of a store or a one-file call) every seal, every shard's checksum in a commit marker and every
item range of an object-store commit is a MAC of the same bytes: only a holder of the key makes one
that verifies. The MAC is HMAC-SHA-256 over the SHA-256 of each 8 MiB piece of the bytes (and their
length), cut to its first 128 bits (RFC 2104 allows it; forging one is a 2^-128 guess, or a SHA-256
collision): the pieces are hashed on every core at once, where one HMAC over the whole file would
hold one core at about 2 GB/s; computed piece by piece as bytes arrive, it is the same MAC.

A reader with a key refuses a file sealed without one, and a reader without a key refuses a keyed
file, each in one line and before a byte is unpickled: neither side is ever taken for the other.
Both seals are the same length, so a keyed file is laid out as an unkeyed one and a plain
`torch.load` still reads it.

The key is in force for a block (`keyed`) in this thread and in the threads a store starts for it
(`thread_in_this_context`); outside any block, `EXACTRESUME_KEY` decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from exactresume.errors import CheckpointError, FieldError, UserError, a_kind_of

KEY_VARIABLE = "EXACTRESUME_KEY"
SHORTEST_KEY = 16  # bytes: a key a person could guess is no key
DIGITS = 32  # hex digits of a seal, keyed or not (128 bits)
UNKEYED_PREFIX, KEYED_PREFIX = b"exactresume-xxh3-128:", b"exactresume-hmac-128:"
MAKE_A_KEY = "python -c 'import secrets; print(secrets.token_hex(32))' makes one"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...

    def copy(self) -> Hasher: ...


PIECE = 8 << 20  # bytes a leaf of the keyed MAC covers
TREE_TAG = b"exactresume-mac-1"  # what the HMAC's message begins with, then the length and every leaf
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it: a forked child makes its own)


def hashing_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="exactresume-mac"))
    return _pool[1]


def _sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()  # OpenSSL's, which lets go of the GIL: the pieces hash at once


def _finish_piece(piece: hashlib._Hash, views: list[memoryview]) -> bytes:
    for view in views:
        piece.update(view)
    return piece.digest()


class PieceMac:
    """HMAC-SHA-256(key, TREE_TAG, length, SHA-256 of each PIECE of the bytes), in hex cut to 128 bits,
    the length of the xxh3 seal it stands for. The whole pieces of one `update` are hashed in parallel;
    it returns once they are, so the caller's buffer is free again. `update_kept` takes bytes that stay
    as they are until `hexdigest`: each piece is hashed on the pool once filled, while the caller goes on."""

    def __init__(self, key: bytes):
        self.key, self.piece, self.filled, self.length = key, hashlib.sha256(), 0, 0
        self.leaves: list[bytes | Future[bytes]] = []
        self.kept: list[memoryview] = []  # the open piece's bytes given to update_kept, not hashed yet

    def update_kept(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.length += len(view)
        while len(view):
            taken = view[: PIECE - self.filled]
            self.kept.append(taken)
            self.filled += len(taken)
            view = view[len(taken) :]
            if self.filled == PIECE:
                self.leaves.append(hashing_pool().submit(_finish_piece, self.piece, self.kept))
                self.piece, self.kept, self.filled = hashlib.sha256(), [], 0

    def add_leaves(self, leaves: list[Future[bytes]]) -> None:
        """The SHA-256 of the next whole pieces, hashed elsewhere (leaves.py), in their order."""
        if self.filled or self.kept:
            raise ValueError("leaves follow whole pieces only")
        self.leaves += leaves
        self.length += len(leaves) * PIECE

    def _hash_kept(self) -> None:
        """Hash the open piece's kept bytes here, before bytes that will not stay follow them."""
        for view in self.kept:
            self.piece.update(view)
        self.kept = []

    def update(self, data: bytes | memoryview) -> None:
        self._hash_kept()
        with memoryview(data) as given, given.cast("B") as view:
            self.length += len(view)
            start = self._fill(view) if self.filled else 0
            whole = (len(view) - start) // PIECE
            pieces = [view[start + n * PIECE : start + (n + 1) * PIECE] for n in range(whole)]
            self.leaves += hashing_pool().map(_sha256, pieces) if whole > 1 else map(_sha256, pieces)
            self._fill(view[start + whole * PIECE :])

    def _fill(self, view: memoryview) -> int:
        """Hash the start of `view` into the open piece, closing it when full; how much was taken."""
        taken = min(PIECE - self.filled, len(view))
        self.piece.update(view[:taken])
        self.filled += taken
        if self.filled == PIECE:
            self.leaves.append(self.piece.digest())
            self.piece, self.filled = hashlib.sha256(), 0
        return taken

    def _settle(self) -> None:
        """Every piece handed to the pool hashed, and the open piece's kept bytes too."""
        self._hash_kept()
        self.leaves = [leaf.result() if isinstance(leaf, Future) else leaf for leaf in self.leaves]

    def hexdigest(self) -> str:
        self._settle()
        leaves = self.leaves + ([self.piece.digest()] if self.filled else [])
        message = TREE_TAG + struct.pack("<Q", self.length) + b"".join(leaves)
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()[:DIGITS]

    def copy(self) -> PieceMac:
        self._settle()
        twin = PieceMac(self.key)
        twin.leaves, twin.piece, twin.filled, twin.length = (
            list(self.leaves),
            self.piece.copy(),
            self.filled,
            self.length,
        )
        return twin


@dataclass(frozen=True)
class Sealing:
    """How seals are made and checked: keyed (HMAC) or not (xxh3). Its repr never shows the key."""

    key: bytes | None = field(default=None, repr=False)

    @property
    def prefix(self) -> bytes:
        """What begins a sealed file's seal: both kinds are 21 bytes, so a seal's length is fixed."""
        return KEYED_PREFIX if self.key is not None else UNKEYED_PREFIX

    def hasher(self) -> Hasher:
        return xxhash.xxh3_128() if self.key is None else PieceMac(self.key)

    def of(self, data: bytes | memoryview) -> str:
        hasher = self.hasher()
        hasher.update(data)
        return hasher.hexdigest()

    def matches(self, digest: str, expected: object) -> bool:
        """Whether `digest` (computed here) is `expected` (recorded), compared in constant time when keyed."""
        if not isinstance(expected, str):
            return False
        return hmac.compare_digest(digest, expected) if self.key is not None else digest == expected


UNKEYED = Sealing()


class SealError(CheckpointError):
    """A file sealed otherwise than the sealing in force: keyed while no key is set, unkeyed while one is,
    or keyed with a key that does not match (another key's, or modified). Its bytes may be sound: a store
    never prunes or writes over it, and one that loaded nothing saves at no step up to its own."""


_given: contextvars.ContextVar[Sealing | None] = contextvars.ContextVar("exactresume_sealing", default=None)


def sealing() -> Sealing:
    """The sealing in force: a `keyed` block's, else `EXACTRESUME_KEY`'s, else none (xxh3)."""
    given = _given.get()
    return given if given is not None else _from_environment()


def _from_environment() -> Sealing:
    value = os.environ.get(KEY_VARIABLE)
    if value is None:
        return UNKEYED
    key = value.encode()
    if len(key) < SHORTEST_KEY:
        raise UserError(
            f"{KEY_VARIABLE} is {len(key)} bytes long: a key is at least {SHORTEST_KEY} ({MAKE_A_KEY}); "
            f"unset it to seal without a key"
        )
    return Sealing(key)


def sealing_for(key: str | bytes | None) -> Sealing | None:
    """The sealing a `key=` argument asks for; None (no argument) leaves `EXACTRESUME_KEY` in force."""
    if key is None:
        return None
    if not isinstance(key, (str, bytes)):
        raise FieldError(f"key must be a str or bytes, got {a_kind_of(key)}", "key")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < SHORTEST_KEY:
        raise FieldError(f"key is {len(raw)} bytes long: a key is at least {SHORTEST_KEY} ({MAKE_A_KEY})", "key")
    return Sealing(raw)


@contextlib.contextmanager
def keyed(chosen: Sealing | None) -> Iterator[None]:
    """`chosen` in force for the block (None: as outside it)."""
    if chosen is None:
        yield
        return
    token = _given.set(chosen)
    try:
        yield
    finally:
        _given.reset(token)


def thread_in_this_context(target: Callable[..., object], args: tuple, name: str) -> threading.Thread:
    """A thread (not started) that runs `target` with the sealing in force here: a store's background
    write seals with the store's key, not with what the environment says."""
    context = contextvars.copy_context()
    return threading.Thread(target=context.run, args=(target, *args), name=name)


def refuse_other_sealing(where: object, recorded_prefix: bytes) -> None:
    """CheckpointError unless a seal that begins `recorded_prefix` is of the sealing in force."""
    if recorded_prefix == sealing().prefix:
        return
    if recorded_prefix == KEYED_PREFIX:
        raise SealError(
            f"{where}: sealed with a key, and no key is set: set {KEY_VARIABLE} (in a loop, key=) "
            f"to the key it was written with to verify it"
        )
    raise SealError(
        f"{where}: sealed without a key, while a key is set: refused, as anyone who can write the file "
        f"could have rewritten it and its checksum"
    )


def mismatch(where: object) -> CheckpointError:
    """The line for a file whose bytes do not hash to its seal: with a key, another key's file reads so too."""
    if sealing().key is not None:
        return SealError(f"{where}: its keyed seal does not match: written with another key, or modified since")
    return CheckpointError(f"{where}: checksum mismatch, the file is damaged (modified or partly written)")
