"""DCP's own file writer, its files hashed as their bytes go out: a sharded save knows each file's
checksum for the commit marker without reading the file again.

DCP writes every file front to back through the stream its file system opens (`create_stream`), so
the hash of what went through the stream is the hash of the file; the disk's writeback is started as
it goes (writeback.py), so DCP's fsync at the end of each file waits for its last piece only. The
save still reads each file back after its folder is renamed into place and checks it against this
hash: the one read a save makes.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from exactresume.store.seal_hash import Hasher, Sealing
from exactresume.store.writeback import WritingBack


class HashingWriter(FileSystemWriter):
    """FileSystemWriter(folder, sync_files=True) whose `digests` map each file it wrote (by name, as
    renamed) to its seal hash."""

    def __init__(self, folder: Path, seals: Sealing):
        super().__init__(folder, sync_files=True)
        self.fs = _HashingFileSystem(seals)

    @property
    def digests(self) -> dict[str, str]:
        return self.fs.digests


class _HashingFileSystem(FileSystem):
    def __init__(self, seals: Sealing):
        super().__init__()
        self.seals, self.digests = seals, {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = _HashedStream(WritingBack(stream), self.seals.hasher())
            with _Gathered(hashed) as gathered:
                yield gathered
        self.digests[Path(path).name] = hashed.hasher.hexdigest()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes its index as .metadata.tmp, then renames it
        if Path(path).name in self.digests:
            self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class _Gathered(io.BufferedWriter):
    """The stream DCP is given: torch.save writes each tensor's file in thousands of small records
    (5,400 a save of the default preset's shard), which this buffer gathers in C before they reach the
    hash and the writeback, both in Python (the save of 20 MB in one process: 77 -> 61 ms, DCP's own
    58-66 ms). Its flush, which DCP calls after each item, keeps the bytes; its fileno (which DCP
    fsyncs) and its close first hand every byte to the file."""

    def __init__(self, raw: io.RawIOBase):
        super().__init__(raw, buffer_size=GATHERED)

    def flush(self) -> None:
        """Nothing: DCP flushes after each item, which would hand the file its bytes a few KB at a time."""

    def fileno(self) -> int:
        self._hand_over()
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._hand_over()
        super().close()

    def _hand_over(self) -> None:
        super().flush()
        self.raw.flush()


GATHERED = 1 << 20


class _HashedStream(io.RawIOBase):
    """The file DCP writes, each byte written also hashed; the rest (tell, fileno for its fsync) the file's."""

    def __init__(self, file: io.IOBase, hasher: Hasher):
        super().__init__()
        self.file, self.hasher = file, hasher

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = self.file.write(data)
        self.hasher.update(memoryview(data).cast("B")[:written])
        return written

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.flush()  # the file itself is closed by the file system's context, after the hash
        super().close()
