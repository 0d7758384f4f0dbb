"""Token files: the .npy stream written as it is encoded, split into train and val, hashed in passes.

`TokenWriter` appends token arrays to `train.npy.tmp` behind a reserved header, so no more than
one chunk of tokens is ever in memory. `finish` cuts the last `val_fraction` of the stream into
`val.npy`, truncates the rest to `train.npy`, writes both headers (byte for byte what `np.save`
writes) and renames them into place. Each file is hashed twice: sha256 for provenance (the data
fingerprint is built from it) and xxh3-128, fast enough to check at every start.
"""

from __future__ import annotations

import hashlib
import io
import math
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from exactresume.atomic import fsync_path, tmp_path
from exactresume.errors import UserError

BUFFER_BYTES = 1 << 20  # read, hashed and copied at a time: one buffer, reused


def npy_header(dtype: np.dtype, length: int) -> bytes:
    """The header `np.save` writes for a 1-D little-endian array of `length` items of `dtype`."""
    buffer = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype).newbyteorder("<"))
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": (length,)})
    return buffer.getvalue()


# numpy pads a 1-D header so the length can grow to 21 digits without moving the data.
HEADER_BYTES = len(npy_header(np.uint16, 0))


def pieces(file: BinaryIO) -> Iterator[memoryview]:
    """The rest of `file` in views of one reused buffer (each valid until the next is made)."""
    buffer = bytearray(BUFFER_BYTES)
    view = memoryview(buffer)
    while count := file.readinto(buffer):
        yield view[:count]


def _file_hashes(path: Path) -> tuple[str, str]:
    """(sha256, xxh3-128) of a file's bytes, read once."""
    sha, fast = hashlib.sha256(), xxhash.xxh3_128()
    with open(path, "rb") as file:
        for piece in pieces(file):
            sha.update(piece)
            fast.update(piece)
    return sha.hexdigest(), fast.hexdigest()


def file_xxh3(path: Path) -> str:
    """xxh3-128 of a file's bytes, hashed in place through a memory map (no copy)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return digest.hexdigest()
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, size, BUFFER_BYTES):
                digest.update(view[start : start + BUFFER_BYTES])
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    return _file_hashes(path)[0]


class TokenWriter:
    """The token stream of `out`/train.npy, appended chunk by chunk, then split into train and val."""

    def __init__(self, train_path: Path, val_path: Path, dtype: np.dtype):
        self.train_path, self.val_path, self.dtype = Path(train_path), Path(val_path), np.dtype(dtype).newbyteorder("<")
        self.tokens = 0
        self.file = open(tmp_path(self.train_path), "wb")  # noqa: SIM115  (closed in finish or abort)
        self.file.write(b"\0" * HEADER_BYTES)

    def write(self, tokens: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self.tokens += len(tokens)

    def abort(self) -> None:
        self.file.close()
        tmp_path(self.train_path).unlink(missing_ok=True)
        tmp_path(self.val_path).unlink(missing_ok=True)

    def finish(self, val_fraction: float) -> dict:
        """Split, write headers, make durable, rename; the manifest fields that describe the two files."""
        train_tokens, val_tokens = split_counts(self.tokens, val_fraction)
        cut = HEADER_BYTES + train_tokens * self.dtype.itemsize
        self.file.close()
        train_tmp, val_tmp = tmp_path(self.train_path), tmp_path(self.val_path)
        with open(train_tmp, "r+b") as train, open(val_tmp, "wb") as val:
            val.write(npy_header(self.dtype, val_tokens))
            train.seek(cut)
            for piece in pieces(train):
                val.write(piece)
            train.truncate(cut)
            train.seek(0)
            train.write(npy_header(self.dtype, train_tokens))
            for file in (train, val):
                file.flush()
                os.fsync(file.fileno())
        fields = {"train_tokens": train_tokens, "val_tokens": val_tokens}
        for name, tmp, final in (("train", train_tmp, self.train_path), ("val", val_tmp, self.val_path)):
            fields[f"{name}_sha256"], fields[f"{name}_xxh3"] = _file_hashes(tmp)
            os.replace(tmp, final)
        fsync_path(self.train_path.parent)
        return fields


def split_counts(tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts: val is the last `val_fraction`, at least one token each side."""
    val_tokens = math.ceil(tokens * val_fraction)
    if val_tokens < 1 or tokens - val_tokens < 1:
        raise UserError(f"corpus too small: {tokens} tokens cannot be split into train and val")
    return tokens - val_tokens, val_tokens


def open_tokens(path: Path) -> np.ndarray:
    """A token file as a read-only memory map: nothing is read until it is indexed."""
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype not in (np.dtype("<u2"), np.dtype("<u4")):
        raise UserError(f"{path} holds {tokens.dtype} of shape {tokens.shape}, not a 1-D uint16 or uint32 token stream")
    return tokens
