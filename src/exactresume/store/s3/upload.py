"""Uploads that take their bytes as they are made: a multipart upload whose parts go up in parallel as
they come, and the file-like object that torch.save writes a sealed checkpoint into.

    upload = SealedUpload(objects, target, before_replace=lambda: objects.delete([commit]))
    save_unsealed(state, upload)       # torch.save's bytes go up in parts while it writes
    info = upload.finish()             # the seal, the last part, the object verified: size and xxh3

A checkpoint saved this way never touches a disk: torch.save's bytes are copied into a part buffer,
hashed there, and each full part is sent by one of UPLOAD_THREADS threads while torch.save goes on.
At most UPLOAD_THREADS parts are in flight, so a save holds about UPLOAD_THREADS + 1 parts in memory
(16 MiB each by default) whatever the state's size; past 1,000 parts they grow, within S3's 10,000.
The object is exactly the file save_sealed writes on a disk: the seal replaces the last two bytes
torch.save wrote (its zip comment's length), so those two are held back until the end. Each part
carries its CRC-32, which the server checks; the composite it reports for the completed object is
compared with ours, and the object's size read back (s3/client.py's check_stored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from exactresume.atomic import write_through
from exactresume.store.locations import S3Location
from exactresume.store.s3.client import UPLOAD_THREADS, ObjectInfo, ObjectStore, b64, crc32
from exactresume.store.seal_hash import sealing
from exactresume.store.sealed import seal_ending

HELD_BACK = 2  # torch.save's last two bytes, the zip comment length the seal rewrites
MAX_PARTS = 10_000  # S3's most parts in one upload
# A stream of unknown size doubles its part size every this many parts: 10,000 parts from 16 MiB hold
# about 16 TiB, past S3's largest object (5 TiB), while a checkpoint of a few GB keeps its small parts.
PARTS_PER_DOUBLING = 1_000


def stream_part_bytes(first: int, number: int) -> int:
    """The size of part `number` (from 1) of a stream whose first parts are `first` bytes."""
    return first << ((number - 1) // PARTS_PER_DOUBLING)


def upload_file(objects: ObjectStore, target: S3Location, path: Path, info: ObjectInfo) -> ObjectInfo:
    """Upload the local file `path`, whose size and xxh3 are `info`, to `target` (one PUT, or parts) and
    verify what the server holds."""
    part_bytes = max(objects.config.part_bytes, -(-info.size // MAX_PARTS))  # a size known beforehand
    with open(path, "rb") as file:
        if info.size <= part_bytes:
            _put_whole(objects, target, file.read())
            return info
        parts = PartsUpload(objects, target)
        try:
            while data := file.read(part_bytes):
                parts.send(data)
            answer, composite = parts.complete()
        except BaseException:
            parts.abort()
            raise
    objects.check_stored(target, info, answer.get("ChecksumCRC32"), composite, parts=True)
    return info


def _put_whole(objects: ObjectStore, target: S3Location, data: bytes) -> ObjectInfo:
    """An object of one part: one PUT, verified (the upload's fault point, as each part of a multipart upload is)."""
    objects.before_part(1)
    return objects.put_bytes(target, data)


class PartsUpload:
    """One multipart upload: `send` each part in order (it waits while UPLOAD_THREADS are in flight, and
    raises a part's error as soon as it is known), then `complete`; `abort` on any failure."""

    def __init__(self, objects: ObjectStore, target: S3Location):
        self.objects, self.what = objects, f"a multipart upload to {target}"
        answer = objects.call(
            "create_multipart_upload", self.what, Bucket=target.bucket, Key=target.key, ChecksumAlgorithm="CRC32"
        )
        self.ids = {"Bucket": target.bucket, "Key": target.key, "UploadId": answer["UploadId"]}
        self.pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="exactresume-upload")
        self.sent: list[Future] = []

    def send(self, data: bytes) -> None:
        """Send the next part (its number: one more than the parts sent before it)."""
        self._wait_for_room()
        self.sent.append(self.pool.submit(self._send, len(self.sent) + 1, data))

    def check(self) -> None:
        """Raise the error of the first part known to have failed."""
        for part in self.sent:
            if part.done() and part.exception() is not None:
                raise part.exception()

    def _wait_for_room(self) -> None:
        while True:
            self.check()
            in_flight = [part for part in self.sent if not part.done()]
            if len(in_flight) < UPLOAD_THREADS:
                return
            wait(in_flight, return_when=FIRST_COMPLETED)

    def _send(self, number: int, data: bytes) -> dict:
        self.objects.before_part(number)
        crc = crc32(data)
        arguments = {**self.ids, "PartNumber": number, "Body": data, "ChecksumCRC32": b64(crc)}
        answer = self.objects.call("upload_part", self.what, **arguments)
        return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": b64(crc), "crc": crc}

    def complete(self) -> tuple[dict, str]:
        """Complete the upload once every part is up: the server's answer and the composite CRC-32 expected."""
        parts = [part.result() for part in self.sent]
        self.pool.shutdown()
        composite = f"{b64(crc32(b''.join(part.pop('crc') for part in parts)))}-{len(parts)}"
        answer = self.objects.call("complete_multipart_upload", self.what, **self.ids, MultipartUpload={"Parts": parts})
        return answer, composite

    def abort(self) -> None:
        """Drop the parts sent (else the next run's start aborts the upload: see ObjectStore.abort_uploads);
        a store that stopped answering is not asked, so the run stops within its bound."""
        self.pool.shutdown(cancel_futures=True)
        if self.objects.unreachable is None:
            with contextlib.suppress(Exception):
                self.objects.client.abort_multipart_upload(**self.ids)


class SealedUpload:
    """A file open for writing, as torch.save sees it (`write`, `flush`, `tell`), whose bytes go to
    `target` as they come; `finish` seals them and completes the object, calling `before_replace` just
    before the object at `target` is replaced (the old commit is deleted there, not earlier).

    torch.save turns an error raised by `write` into a RuntimeError about zip positions; `save` raises
    the first such error instead, so a store that stops answering is reported as what it is."""

    def __init__(self, objects: ObjectStore, target: S3Location, before_replace: Callable[[], Any]):
        self.objects, self.target, self.before_replace = objects, target, before_replace
        self.pending, self.position = bytearray(), 0
        self.sent_digest = sealing().hasher()  # of every byte sent so far
        self.parts: PartsUpload | None = None  # made when the first part is full: a small object is one PUT
        self.error: Exception | None = None  # the first error `write` raised

    def save(self, write: Callable[[Any], None]) -> None:
        """`write(self)` (torch.save's), raising the first error of ours it met rather than torch's."""
        write_through(self, write)

    def write(self, data: bytes | memoryview) -> int:
        try:
            # torch.save lends its own buffer for the call only: the bytes are copied.
            self.pending += data
            count = memoryview(data).nbytes
            self.position += count
            while len(self.pending) >= (part_bytes := self._next_part_bytes()) + HELD_BACK:
                self._send(part_bytes)
        except Exception as error:
            self.error = self.error or error
            raise
        return count

    def _next_part_bytes(self) -> int:
        sent = len(self.parts.sent) if self.parts is not None else 0
        return stream_part_bytes(self.objects.config.part_bytes, sent + 1)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.position

    def _send(self, count: int) -> None:
        view = memoryview(self.pending)
        part = bytes(view[:count])
        view.release()
        del self.pending[:count]  # a bytearray drops its front without copying the rest
        self.sent_digest.update(part)
        if self.parts is None:
            self.parts = PartsUpload(self.objects, self.target)
        self.parts.send(part)

    def finish(self) -> ObjectInfo:
        """Seal the bytes torch.save wrote, send the last of them and verify the stored object: its size and xxh3."""
        length = bytes(self.pending[-HELD_BACK:])
        del self.pending[-HELD_BACK:]  # the rest of the last part, which the seal's bytes then end
        self.sent_digest.update(self.pending)
        saved = self.sent_digest.copy()
        saved.update(length)
        ending = seal_ending(saved.hexdigest())
        self.sent_digest.update(ending)
        self.pending += ending
        last = bytes(self.pending)
        info = ObjectInfo(self.position - HELD_BACK + len(ending), self.sent_digest.hexdigest())
        if self.parts is not None:
            self.parts.check()  # a store that stopped answering is not asked to delete the old commit
        self.before_replace()
        if self.parts is None:
            _put_whole(self.objects, self.target, last)
        else:
            self.parts.send(last)
            answer, composite = self.parts.complete()
            self.objects.check_stored(self.target, info, answer.get("ChecksumCRC32"), composite, parts=True)
        return info

    def abort(self) -> None:
        if self.parts is not None:
            self.parts.abort()
