"""Where a checkpoint lives: a local path, or `s3://bucket/prefix` on an object store.

    location("runs/a/checkpoints")          -> Path("runs/a/checkpoints")
    location("s3://bucket/runs/a")          -> S3Location("bucket", "runs/a")
    location("s3://bucket/runs/a", S3Config(endpoint="http://127.0.0.1:8333"))

`pathlib.Path("s3://bucket/key")` folds the two slashes into one, so every flag and argument that
may name an object store is parsed here first, and a `Path` is made only for what is local. An
`S3Location` carries how its store is reached (`S3Config`: the endpoint, how many tries) but never a
credential: those come from the standard AWS chain (environment, profile, instance role) when the
client is made (s3/client.py), so no location, log line or checkpoint can hold one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from exactresume.errors import UserError

SCHEME = "s3://"
# S3's rules for a bucket name: 3 to 63 lowercase letters, digits, dots and hyphens.
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
DEFAULT_TRIES = 5  # each request, the first try included, before an unreachable store stops the run
CONNECT_SECONDS = 5.0  # a server that takes longer to accept a connection is not answering
READ_SECONDS = 30.0  # the longest wait for any byte of an answer (or for room to send): a frozen server's bound
PART_BYTES = 16 << 20  # a file larger than this goes up as a multipart upload of parts this size (see s3/upload.py)
MIN_PART_BYTES = 5 << 20  # S3's smallest part (all but the last)


@dataclass(frozen=True)
class S3Config:
    """How an object store is reached: its endpoint (None: AWS_ENDPOINT_URL or AWS itself), how long one
    try of a request may wait (to connect, then for each read or send), and how often a request is
    tried before the store is called unreachable (with backoff: 0.5 s, 1 s, 2 s, ...)."""

    endpoint: str | None = None
    tries: int = DEFAULT_TRIES
    part_bytes: int = PART_BYTES
    connect_timeout: float = CONNECT_SECONDS
    read_timeout: float = READ_SECONDS

    def __post_init__(self) -> None:
        if self.tries < 1:
            raise UserError(f"--s3-tries must be at least 1, got {self.tries}")
        if not 0 < self.read_timeout <= 3600 or not 0 < self.connect_timeout <= 3600:
            raise UserError(f"--s3-timeout must be above 0 and at most 3600 seconds, got {self.read_timeout:g}")
        if self.part_bytes < MIN_PART_BYTES:
            raise UserError(f"--s3-part-mib must be at least {MIN_PART_BYTES >> 20}, got {self.part_bytes / 2**20:g}")
        # No user info (user:secret@host): an endpoint is printed in error lines, a credential never is.
        if self.endpoint is not None:
            _check_endpoint(self.endpoint)

    def bound(self) -> float:
        """The longest a run waits on a store that stopped answering: a request's tries, each of which
        connects and waits for the server (at most the two timeouts), the backoff between them, and one
        more try, of the requests then in flight (a save's other parts)."""
        return (self.tries + 1) * (self.connect_timeout + self.read_timeout) + _backoff_seconds(self.tries)


def _backoff_seconds(tries: int) -> float:
    """The sleeps between `tries` tries of one request: 0.5 s, 1 s, 2 s, ..."""
    return sum(0.5 * 2**attempt for attempt in range(tries - 1))


def _check_endpoint(endpoint: str, given_as: str = "--s3-endpoint") -> None:
    """UserError unless `endpoint` is http(s)://host[:port], in a line that names where it was given
    (`given_as`: the flag, or the environment variable) and says what is wrong with it."""
    if re.match(r"^https?://[^/\s@]+/?$", endpoint):
        return
    if "@" in endpoint:  # user info (user:secret@host): an endpoint is printed in error lines, a credential never is
        raise UserError(f"{given_as} holds user info; credentials go in the AWS chain (environment or profile)")
    if "://" not in endpoint:
        raise UserError(f"{given_as} {endpoint}: the scheme is missing; give http://{endpoint} (or https:// for TLS)")
    raise UserError(f"{given_as} {endpoint} is not an http(s)://host[:port] URL")


def environment_endpoint() -> tuple[str, str] | None:
    """The endpoint the AWS environment names for S3 (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL) and its
    variable's name; None when neither is set."""
    for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(variable):
            return os.environ[variable], variable
    return None


def check_environment_endpoint() -> None:
    """The environment's endpoint held to what --s3-endpoint is (boto3 would raise its own ValueError)."""
    named = environment_endpoint()
    if named is not None:
        _check_endpoint(*named)


@dataclass(frozen=True)
class S3Location:
    """An object, or a prefix of objects (a folder's counterpart), in one bucket."""

    bucket: str
    key: str  # without leading or trailing slash; "" is the whole bucket
    config: S3Config = field(default=S3Config(), compare=False)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def __truediv__(self, name: str) -> S3Location:
        """The object or prefix `name` under this prefix (as `Path / name`)."""
        return replace(self, key=f"{self.key}/{name}".lstrip("/"))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Location:
        return replace(self, key=self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    @property
    def prefix(self) -> str:
        """The key prefix of the objects under this location, ending in a slash ("" for the bucket)."""
        return f"{self.key}/" if self.key else ""

    def with_name(self, name: str) -> S3Location:
        return self.parent / name


Location = Path | S3Location


def is_s3(value: object) -> bool:
    """Whether `value` names an object store location (an S3Location or an `s3://` string)."""
    return isinstance(value, S3Location) or (isinstance(value, str) and value.startswith(SCHEME))


# A scheme and a colon: what a URL begins with (two letters at least: `C:/` is a drive, not a scheme).
URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")


def not_a_url(text: str) -> str | None:
    """Why `text`, given as a folder or file, is none: it begins as a URL other than s3:// (`s3:/bucket`,
    `s3:bucket`, `gs://bucket`), which would otherwise be a folder made here; None when it is a plain path."""
    if is_s3(text) or not (URL_START.match(text) or text.lower().startswith("s3:")):
        return None
    return (
        f"{text} begins as a URL: an object store location is s3://BUCKET/PREFIX (its server from "
        "--s3-endpoint, or S3Config), and a folder is a plain path"
    )


def location(value: str | Path | S3Location, config: S3Config | None = None) -> Location:
    """`value` as a Path, or as an S3Location reached through `config` (UserError for a malformed one)."""
    if isinstance(value, S3Location):
        return value if config is None else replace(value, config=config)
    if isinstance(value, str) and (why := not_a_url(value)) is not None:
        raise UserError(why)
    if not is_s3(value):
        return Path(value)
    bucket, _, key = str(value)[len(SCHEME) :].partition("/")
    if not BUCKET_NAME.match(bucket):
        raise UserError(f"{value}: {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, '.', '-')")
    key = key.strip("/")
    if "//" in key or any(part in (".", "..") for part in key.split("/")):
        raise UserError(f"{value}: a key with an empty, '.' or '..' part is not a place for a checkpoint")
    return S3Location(bucket, key, config or S3Config())


def _with_config(value: object, config: S3Config) -> object:
    """`value` reached through `config` when it is an object store location; anything else as it is."""
    return replace(value, config=config) if isinstance(value, S3Location) else value


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a store (a file, or an object): where it lives and the step its name says it holds."""

    step: int
    path: Location
