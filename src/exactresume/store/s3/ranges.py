"""A sharded checkpoint on an object store read by ranged GETs: a rank fetches only the items it loads.

DCP stores each saved chunk of a tensor (and each pickled value) as one item, a byte range of a
shard file. When a rank resumes with another layout (FSDP2 on N -> M processes), DCP loads only
the items that overlap this rank's rows; here each of them is one ranged GET. The whole-object
xxh3 of the commit cannot vouch for a range, so the commit also records the xxh3 of every item
(`ranges`: file -> [[offset, length, xxh3], ...]), which each rank computes for its own files at
save time; an item is used only once its bytes match.

    ranges = item_ranges(staging, metadata, own_files)            # at save time, per rank
    reader = ranged_reader(objects, target, folder, commit)       # at load time: a DCP StorageReader
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from exactresume.errors import CheckpointError, MissingObject
from exactresume.store.dcp_index import VerifiedReader
from exactresume.store.locations import S3Location
from exactresume.store.s3.client import ObjectStore
from exactresume.store.seal_hash import sealing

RANGES_KEY = "ranges"


def item_ranges(staging: Path, metadata: Metadata, own: set[str]) -> dict[str, list[list]]:
    """[offset, length, xxh3] of every item DCP placed in the files of `own` (this rank's), by file."""
    found: dict[str, list[list]] = {}
    for info in (metadata.storage_data or {}).values():
        if info.relative_path in own:
            with open(staging / info.relative_path, "rb") as file:
                file.seek(info.offset)
                digest = sealing().of(file.read(info.length))
            found.setdefault(info.relative_path, []).append([info.offset, info.length, digest])
    return {name: sorted(items) for name, items in found.items()}


class RangedObject:
    """One shard object as a read-only file: a read inside an item fetches that item (one ranged GET),
    verified against its recorded xxh3 before a byte of it is returned."""

    def __init__(self, objects: ObjectStore, source: S3Location, items: list[list]):
        self.objects, self.source, self.items = objects, source, sorted(items)
        self.starts = [offset for offset, _, _ in self.items]
        self.position, self.cached_at, self.cached = 0, -1, b""

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.position = offset if whence == os.SEEK_SET else self.position + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _item(self) -> tuple[int, bytes]:
        """The verified bytes of the item the position lies in, and where it starts."""
        index = bisect.bisect_right(self.starts, self.position) - 1
        offset, length, digest = self.items[index] if index >= 0 else (0, 0, "")
        if not offset <= self.position < offset + length:
            raise CheckpointError(f"{self.source}: DCP reads at {self.position:,}, outside every committed item")
        if self.cached_at != offset:
            try:
                data = self.objects.get_range(self.source, offset, length)
            except MissingObject:
                raise CheckpointError(f"{self.source} is missing, though its commit names it") from None
            if len(data) != length or not sealing().matches(sealing().of(data), digest):
                raise CheckpointError(f"{self.source}: bytes {offset:,}+{length:,} are damaged (checksum mismatch)")
            self.cached_at, self.cached = offset, data
        return offset, self.cached

    def read(self, size: int = -1) -> bytes:
        offset, data = self._item()
        start = self.position - offset
        end = len(data) if size is None or size < 0 else min(len(data), start + size)
        self.position += end - start
        return data[start:end]

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


class _ObjectFiles(FileSystem):
    """DCP's file system with shard files that are objects read by range (the index stays a local file)."""

    def __init__(self, objects: ObjectStore, target: S3Location, ranges: dict[str, list[list]]):
        super().__init__()
        self.objects, self.target, self.ranges = objects, target, ranges

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        name = Path(path).name
        if name not in self.ranges:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        yield RangedObject(self.objects, self.target / name, self.ranges[name])


def ranged_reader(objects: ObjectStore, target: S3Location, folder: Path, commit: dict) -> VerifiedReader:
    """A DCP reader of `folder` (holding the verified .metadata) whose shard files are read by range."""
    ranges = commit.get(RANGES_KEY)
    if not isinstance(ranges, dict) or not all(isinstance(items, list) for items in ranges.values()):
        raise CheckpointError(f"{target}: its commit records no item ranges")
    reader = VerifiedReader(folder)
    reader.fs = _ObjectFiles(objects, target, ranges)
    return reader
