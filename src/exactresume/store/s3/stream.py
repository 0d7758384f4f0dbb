"""A committed sealed object loaded as it streams in: one GET, no local copy, every byte hashed once.

    state = load_streamed(objects, location, ObjectInfo(size, xxh3))   # or NOT_STREAMED

The object is read as a file by onepass.py, which reads a sealed torch file once from its start,
every storage record straight into the memory of its tensor, and unpickles only once the seal
matches. Here that one pass is the body of a single GET; what the reader first needs from the end
(the zip's end record, its central directory, the seal) comes from one ranged GET of the tail.
Every streamed byte also feeds the xxh3 that the commit records, checked with the size at the end,
so the bytes loaded are the bytes committed. A file onepass.py does not read (another zip layout,
a torch.load wrapped by the doctor's tracer) gives NOT_STREAMED, and is downloaded and loaded as a
file instead (s3/files.py).
"""

from __future__ import annotations

import os
from typing import Any

from exactresume.errors import CheckpointError
from exactresume.store.locations import S3Location
from exactresume.store.onepass import NOT_READ, load_verified
from exactresume.store.s3.client import READ_PIECE, ObjectInfo, ObjectStore
from exactresume.store.seal_hash import sealing
from exactresume.store.sealed import SEAL_LENGTH, seal_of, torch_load_is_wrapped

NOT_STREAMED = object()
TAIL_BYTES = 1 << 20  # the end of the object fetched first: end record, central directory, seal


class StreamedObject:
    """An object as a read-only file: sequential reads from its start come from one streaming GET (and
    are hashed), reads elsewhere from its tail, fetched once, or a ranged GET of their own."""

    def __init__(self, objects: ObjectStore, source: S3Location, size: int):
        self.objects, self.source, self.size = objects, source, size
        self.tail_start = max(0, size - TAIL_BYTES)
        self.tail = objects.get_range(source, self.tail_start, size - self.tail_start)
        if len(self.tail) != size - self.tail_start:
            raise CheckpointError(f"{source} is shorter than its commit says ({size:,} bytes): truncated or replaced")
        self.position = self.streamed = 0
        self.sealing = sealing()
        self.digest, self.body = self.sealing.hasher(), None
        # keyed, the bytes read are hashed on the other cores while more arrive: a buffer given to
        # readinto must stay as it is until `finish` (a tensor's memory does; `read` gives each its own)
        self.hash = self.digest.update_kept if self.sealing.key is not None else self.digest.update

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = min(max(0, base + offset), self.size)
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, count: int = -1) -> bytes:
        count = self.size - self.position if count is None or count < 0 else min(count, self.size - self.position)
        if self.position != self.streamed:
            data = self._elsewhere(count)
            self.position += len(data)
            return data
        data = bytearray(count)
        return bytes(data[: self.readinto(data)])

    def readinto(self, buffer) -> int:
        """Into `buffer` (a tensor's memory, for a storage record): copied once from the arriving bytes."""
        view = memoryview(buffer).cast("B")
        count = min(len(view), self.size - self.position)
        if self.position != self.streamed:
            data = self._elsewhere(count)
            view[: len(data)] = data
            self.position += len(data)
            return len(data)
        if self.body is None:
            self.body = self.objects.body(self.source)
        done = 0
        while done < count:
            arrived = self._arrive(view[done:count])
            if not arrived:
                break
            self.hash(view[done : done + arrived])
            done += arrived
        self.position += done
        self.streamed += done
        return done

    def _arrive(self, view: memoryview) -> int:
        """Bytes of the GET straight into `view`; 0 at its end (a connection cut mid-body is one line)."""
        try:
            return self.body.readinto(view)
        except Exception as error:  # urllib3's and the socket's many types
            raise self.objects.broke_off(self.source, error) from None

    def _elsewhere(self, count: int) -> bytes:
        if self.position >= self.tail_start:
            start = self.position - self.tail_start
            return self.tail[start : start + count]
        return self.objects.get_range(self.source, self.position, count)

    def finish(self, expected: ObjectInfo) -> None:
        """Read what the loader left (the seal) and hold the whole object to its commit."""
        self.seek(self.streamed)
        while self.read(READ_PIECE):
            pass
        if self.streamed != expected.size:
            raise CheckpointError(f"{self.source} holds {self.streamed:,} bytes, its commit says {expected.size:,}")
        if not self.sealing.matches(self.digest.hexdigest(), expected.digest):
            raise CheckpointError(f"{self.source}: checksum mismatch against its commit, the object is damaged")


def load_streamed(objects: ObjectStore, source: S3Location, expected: ObjectInfo) -> Any:
    """The verified contents of a committed sealed object, read as it streams in; NOT_STREAMED where
    it must be downloaded and loaded as a file."""
    if torch_load_is_wrapped() or expected.size < TAIL_BYTES:
        return NOT_STREAMED
    stream = StreamedObject(objects, source, expected.size)
    recorded = seal_of(stream)
    if recorded is None:
        return NOT_STREAMED  # the file way says what is wrong with it
    loaded = load_verified(source, stream, recorded, SEAL_LENGTH, size=expected.size)
    if loaded is NOT_READ:
        return NOT_STREAMED
    stream.finish(expected)
    return loaded
