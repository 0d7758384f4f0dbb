"""One bucket's objects through boto3: small objects put verified, objects read verified, list, delete, abort.

    objects = ObjectStore(S3Config(endpoint="http://127.0.0.1:8333"))
    info = objects.put_bytes(location("s3://bucket/run/step-00000030.pth.commit"), data)   # size + xxh3
    objects.get_file(location, into_path, info)       # CheckpointError unless the bytes are `info`'s

boto3 is AWS's own SDK: the standard credential chain (environment, profile, instance role),
`AWS_ENDPOINT_URL` for an S3-compatible server, checksums the server verifies, ranged GETs; it is
made lazily, on the first request, so a command that reaches no store never imports it. Large
objects go up in parts (s3/upload.py). Every object or part carries its CRC-32, which the server
checks on arrival and reports back, and a multipart object's size is read back with HEAD: a part
the server lost (mlcommons/storage #593) changes both (`check_stored`). A server that reports no
checksum gets the object read back and hashed instead.

Every request is tried `S3Config.tries` times with backoff (0.5 s, 1 s, 2 s, ...) while the server
does not answer or answers 5xx, each try bounded by the connect and read timeouts (a frozen server
accepts connections but never answers); then the run stops with one StorageError line naming the
endpoint, never a credential (an endpoint with user info is refused in locations.py). An endpoint
that answers HTTP without S3's error documents is named as the wrong port it most likely is.
"""

from __future__ import annotations

import base64
import functools
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactresume.errors import CheckpointError, MissingObject, StorageError, UserError
from exactresume.store.locations import S3Config, S3Location, check_environment_endpoint, environment_endpoint
from exactresume.store.seal_hash import sealing
from exactresume.store.sealed import file_digest

READ_PIECE = 8 << 20  # a download is written and hashed this many bytes at a time
UPLOAD_THREADS = 4  # parts of one multipart upload in flight at once
ONE_COPY_LIMIT = 5 << 30  # S3's largest object one CopyObject copies; a larger one is copied in parts
COPY_PART = 1 << 30
# Answers worth another try: a busy or failing server, and bytes damaged on the way (BadDigest).
RETRIED_CODES = {"SlowDown", "Throttling", "RequestTimeout", "InternalError", "ServiceUnavailable", "BadDigest"}
# AWS's answers to a request signed for, or sent to, another region than the bucket's.
WRONG_REGION_CODES = {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}


@dataclass(frozen=True)
class ObjectInfo:
    """What a commit records of one object: its size and the seal's hash of its bytes (seal_hash.py)."""

    size: int
    digest: str


def file_info(path: Path) -> ObjectInfo:
    """The size and seal hash of a local file."""
    return ObjectInfo(os.path.getsize(path), file_digest(path))


def crc32(data: bytes | memoryview) -> bytes:
    """The CRC-32 of `data`, big-endian: what S3's checksum headers carry (in base64)."""
    return struct.pack(">I", zlib.crc32(data))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class ObjectStore:
    """The requests exactresume makes of an object store, each retried, each error one line."""

    def __init__(self, config: S3Config | None = None):
        self.config = config or S3Config()
        self._client: Any = None
        self._made = threading.Lock()
        self.before_part: Callable[[int], None] = lambda number: None  # faults.py's upload point
        # Set once a request ran out of tries: the requests then in flight (a save's other parts) stop
        # after their current try, so the run ends within one more try, not a whole request's tries.
        self.unreachable: StorageError | None = None
        self.unreachable_since = 0.0  # time.monotonic() when it was set; later requests try as usual
        self.answered_at = 0.0  # time.monotonic() of the last answer: a store that answers again is back

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to, as an error line names it."""
        environment = environment_endpoint()
        return self.config.endpoint or (environment and environment[0]) or "AWS S3"

    @property
    def client(self) -> Any:
        with self._made:
            if self._client is None:
                self._client = _make_client(self.config)
        return self._client

    def call(self, operation: str, what: str, then: Callable[[Any], Any] | None = None, **arguments: Any) -> Any:
        """`client.<operation>(**arguments)`, retried with backoff while the store does not answer; with
        `then`, `then(answer)` (reading its body) is part of each try."""
        client = self.client  # first: without boto3, the one line that says how to install it
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        started, answered = time.monotonic(), False
        for attempt in range(self.config.tries):
            try:
                answer = getattr(client, operation)(**arguments)
                answer = answer if then is None else then(answer)
                self.answered_at = time.monotonic()
                return answer
            except NoCredentialsError:
                raise UserError(
                    f"no AWS credentials for {what} (environment, ~/.aws profile or instance role)"
                ) from None
            except ClientError as error:
                code = error.response.get("Error", {}).get("Code", "")
                status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                # No S3 error document (botocore then gives the status as the code): not an S3 server.
                if code.isdigit() and status < 500 and operation != "head_object":
                    raise _not_s3(self.endpoint, what, f"HTTP {status}") from None
                if code not in RETRIED_CODES and status < 500:
                    raise _refusal(what, code, error) from None
                reason, answered = f"HTTP {status} {code}".strip(), True
            except BotoCoreError as error:
                if type(error).__name__ == "ResponseParserError":
                    raise _not_s3(self.endpoint, what, "an answer that is not S3's XML") from None
                reason, answered = self._reason(error), False
            except (OSError, ValueError) as error:  # a body cut or timed out as `then` read it (urllib3's types)
                reason, answered = type(error).__name__, False
            if self.unreachable is not None and self.unreachable_since >= started:
                raise self.unreachable
            if attempt + 1 < self.config.tries:
                time.sleep(0.5 * 2**attempt)
        self.unreachable, self.unreachable_since = self._gave_up(what, reason, answered), time.monotonic()
        raise self.unreachable

    def gave_up(self) -> bool:
        """Whether the last request that ran out of tries came after the last answer: the store is down."""
        return self.unreachable is not None and self.unreachable_since > self.answered_at

    def _gave_up(self, what: str, reason: str, answered: bool) -> StorageError:
        """The line for a request that ran out of tries: no answer, or (`answered`) the server's own error."""
        if answered:
            failed = f"answered {what} with a server error ({reason}; {self.config.tries} tries: see its log)"
        else:
            failed = f"did not answer {what} ({reason}; {self.config.tries} tries)"
        return StorageError(
            f"the object store at {self.endpoint} {failed}; the committed checkpoints are unchanged: once it is "
            "back, run again (a training run with --resume auto)"
        )

    def _reason(self, error: Exception) -> str:
        """Why a try got no answer, with its likely cause."""
        name = type(error).__name__
        if name == "EndpointConnectionError":
            return "could not connect: nothing listens there, or the host or port is wrong"
        if name == "ConnectTimeoutError":
            return f"no connection within {self.config.connect_timeout:g} s"
        if name == "ReadTimeoutError":
            return f"no answer within {self.config.read_timeout:g} s: a frozen or overloaded server"
        return str(error).split(":")[0]

    # -- writing ---------------------------------------------------------------------------------

    def put_bytes(self, target: S3Location, data: bytes) -> ObjectInfo:
        """Upload a small object in one PUT and verify what the server holds (`check_stored`); its size and digest."""
        info = ObjectInfo(len(data), sealing().of(data))
        checksum = b64(crc32(data))
        answer = self.call(
            "put_object", f"PUT {target}", Bucket=target.bucket, Key=target.key, Body=data, ChecksumCRC32=checksum
        )
        self.check_stored(target, info, answer.get("ChecksumCRC32"), checksum)
        return info

    def check_stored(
        self, target: S3Location, info: ObjectInfo, reported: str | None, expected: str, parts: bool = False
    ) -> None:
        """The server holds `info`'s bytes: its checksum is ours (and after a multipart upload, whose
        parts a server may lose, its size is right), else the object is read back and hashed."""
        if parts or reported is None:
            size = self.size(target)
            if size != info.size:
                raise OSError(f"{target} was stored with {size} bytes, not {info.size}: the upload lost bytes")
        if reported is None:  # a server that keeps no checksum: read the object back
            if not sealing().matches(self.digest(target), info.digest):
                raise OSError(f"{target} read back with other bytes than were uploaded")
        elif reported != expected:
            raise OSError(f"{target}: the server's checksum {reported} is not the uploaded bytes' {expected}")

    # -- reading ---------------------------------------------------------------------------------

    def size(self, target: S3Location) -> int | None:
        """The size of the object at `target`, or None when there is none."""
        try:
            return self.call("head_object", f"HEAD {target}", Bucket=target.bucket, Key=target.key)["ContentLength"]
        except MissingObject:
            return None

    def body(self, target: S3Location) -> Any:
        """The open body of one GET of the whole object: a file-like object with `readinto` (urllib3's)."""
        body = self.call("get_object", f"GET {target}", Bucket=target.bucket, Key=target.key)["Body"]
        return getattr(body, "_raw_stream", body)  # botocore's wrapper reads only into new bytes

    def _chunks(self, target: S3Location) -> Iterator[bytes]:
        body = self.call("get_object", f"GET {target}", Bucket=target.bucket, Key=target.key)["Body"]
        try:
            yield from body.iter_chunks(READ_PIECE)
        except Exception as error:  # a connection cut mid-body: botocore's and urllib3's many types
            raise self.broke_off(target, error) from None

    def broke_off(self, target: S3Location, error: Exception) -> StorageError:
        """A GET whose body stopped coming (cut, or nothing within the read timeout) as one line."""
        name = type(error).__name__
        reason = f"no bytes within {self.config.read_timeout:g} s" if "Timeout" in name else name
        return StorageError(
            f"the object store at {self.endpoint} broke off GET {target} ({reason}); "
            "the committed checkpoints are unchanged: once it is back, run again (a training run with --resume auto)"
        )

    def digest(self, target: S3Location) -> str:
        """The seal hash of the object's bytes, read back."""
        digest = sealing().hasher()
        for chunk in self._chunks(target):
            digest.update(chunk)
        return digest.hexdigest()

    def get_bytes(self, target: S3Location) -> bytes:
        return b"".join(self._chunks(target))

    def get_range(self, target: S3Location, start: int, length: int) -> bytes:
        """`length` bytes of the object from `start` (one ranged GET)."""
        if length == 0:
            return b""
        span = f"bytes={start}-{start + length - 1}"
        return self.call(
            "get_object",
            f"GET {target}",
            lambda answer: answer["Body"].read(),
            Bucket=target.bucket,
            Key=target.key,
            Range=span,
        )

    def download(self, source: S3Location, path: Path) -> ObjectInfo:
        """Write the object at `source` to `path`, hashing as it is written; its size and digest."""
        digest, size = sealing().hasher(), 0
        with open(path, "wb") as file:
            for chunk in self._chunks(source):
                digest.update(chunk)
                file.write(chunk)
                size += len(chunk)
        return ObjectInfo(size, digest.hexdigest())

    def get_file(self, source: S3Location, path: Path, expected: ObjectInfo) -> None:
        """Download `source` to `path`; CheckpointError unless its bytes are `expected`'s."""
        got = self.download(source, path)
        if got.size != expected.size:
            raise CheckpointError(
                f"{source} holds {got.size:,} bytes, its commit says {expected.size:,}: truncated or replaced"
            )
        if not sealing().matches(got.digest, expected.digest):
            raise CheckpointError(f"{source}: checksum mismatch against its commit, the object is damaged")

    def list(self, prefix: S3Location) -> dict[str, int]:
        """Every object under `prefix` (a folder's counterpart): name below the prefix -> size, all pages."""
        found, token = {}, None
        while True:
            more = {"ContinuationToken": token} if token else {}
            page = self.call(
                "list_objects_v2", f"the listing of {prefix}", Bucket=prefix.bucket, Prefix=prefix.prefix, **more
            )
            for entry in page.get("Contents", []):
                found[entry["Key"][len(prefix.prefix) :]] = entry["Size"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    def copy(self, source: S3Location, target: S3Location, size: int) -> None:
        """`source` (of `size` bytes) copied to `target` by the server: no byte passes through this machine.
        Above S3's limit for one CopyObject, in parts; an interrupted one is a leftover upload (abort_uploads)."""
        origin, what = {"Bucket": source.bucket, "Key": source.key}, f"the copy of {source} to {target}"
        named = {"Bucket": target.bucket, "Key": target.key}
        if size <= ONE_COPY_LIMIT:
            self.call("copy_object", what, CopySource=origin, **named)
            return
        upload = self.call("create_multipart_upload", what, **named)["UploadId"]
        parts = []
        for number, start in enumerate(range(0, size, COPY_PART), 1):
            span = f"bytes={start}-{min(start + COPY_PART, size) - 1}"
            copied = self.call(
                "upload_part_copy",
                what,
                UploadId=upload,
                PartNumber=number,
                CopySource=origin,
                CopySourceRange=span,
                **named,
            )
            parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
        self.call("complete_multipart_upload", what, UploadId=upload, MultipartUpload={"Parts": parts}, **named)

    # -- removing --------------------------------------------------------------------------------

    def delete(self, targets: list[S3Location]) -> None:
        """Delete objects (a thousand a request, S3's most)."""
        for start in range(0, len(targets), 1000):
            batch = targets[start : start + 1000]
            objects = {"Objects": [{"Key": target.key} for target in batch], "Quiet": True}
            what = f"DELETE under {batch[0].parent}"
            answer = self.call("delete_objects", what, Bucket=batch[0].bucket, Delete=objects)
            if answer.get("Errors"):
                failed = answer["Errors"][0]
                raise OSError(f"could not delete s3://{batch[0].bucket}/{failed.get('Key')}: {failed.get('Code')}")

    def abort_uploads(self, prefix: S3Location) -> int:
        """Abort the multipart uploads under `prefix` that a killed save left (they cost storage): how many."""
        aborted, markers = 0, {}
        while True:
            what = f"the uploads under {prefix}"
            page = self.call("list_multipart_uploads", what, Bucket=prefix.bucket, Prefix=prefix.prefix, **markers)
            for upload in page.get("Uploads", []) or []:
                ids = {"Bucket": prefix.bucket, "Key": upload["Key"], "UploadId": upload["UploadId"]}
                self.call("abort_multipart_upload", f"aborting an upload under {prefix}", **ids)
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page.get("NextKeyMarker"), "UploadIdMarker": page.get("NextUploadIdMarker")}


class WriteRaced(UserError):
    """A conditional PUT (If-None-Match, If-Match) the object store refused: another writer came first."""


def _not_s3(endpoint: str, what: str, answer: str) -> UserError:
    """An endpoint that answers HTTP but not as S3 does: most likely another port of the server."""
    return UserError(
        f"{endpoint} answered {what} with {answer}, not as an S3 server: is --s3-endpoint the S3 port "
        "(SeaweedFS 8333, MinIO 9000), not a filer, console or web port?"
    )


def _refusal(what: str, code: str, error: Exception) -> Exception:
    """A store's refusal as one line: a missing object is a checkpoint's problem, the rest the user's."""
    if code in ("NoSuchKey", "404", "NotFound"):
        return MissingObject(f"{what}: no such object")
    if code in ("PreconditionFailed", "ConditionalRequestConflict"):  # a conditional PUT lost its race
        return WriteRaced(f"{what}: another writer's PUT came first")
    if code == "InvalidRange":
        return CheckpointError(f"{what}: the object is shorter than its commit says: truncated or replaced")
    if code == "NoSuchBucket":
        return UserError(f"{what}: the bucket does not exist")
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return UserError(f"{what}: access denied ({code}); check the AWS credentials and the bucket's policy")
    if code in WRONG_REGION_CODES:
        return UserError(
            f"{what}: refused ({code}): the bucket is in another region; set AWS_REGION (or the profile's region) to it"
        )
    return UserError(f"{what}: refused by the object store ({code or type(error).__name__})")


def _make_client(config: S3Config) -> Any:
    """A boto3 S3 client: credentials from the standard chain (a session of its own, which resolves them
    again), our own retries (boto3's are turned off), and the process's one reader of botocore's models."""
    try:
        import boto3  # noqa: F401  (the SDK the [s3] extra installs; its clients are botocore's own)
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise UserError("s3:// locations need boto3: pip install 'exactresume[s3]'") from None

    if config.endpoint is None:
        check_environment_endpoint()
    settings = Config(
        retries={"total_max_attempts": 1},
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,  # also bounds each send: a frozen server's full buffers
        max_pool_connections=UPLOAD_THREADS * 4,
        request_checksum_calculation="when_required",  # we send each part's CRC-32 ourselves
        response_checksum_validation="when_required",
    )
    session = botocore.session.Session()
    session.register_component("data_loader", _models(session.get_config_variable("data_path")))
    return session.create_client("s3", endpoint_url=config.endpoint, config=settings)


@functools.cache
def _models(data_path: str | None) -> Any:
    """botocore's loader of its JSON models (and of any in AWS_DATA_PATH, as a session's own would be), shared
    by every session of this process: a new one parses S3's model again, 0.1 s of CPU a client."""
    import botocore.loaders

    return botocore.loaders.create_loader(data_path)
