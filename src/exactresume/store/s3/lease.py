"""One writer per prefix: a lease object, PREFIX/.exactresume.lease, held while a run writes the prefix.

    lease = S3Lease.acquire(objects, prefix)   # or UserError: "s3://b/run is being written by pid 1234 ..."
    lease.check()                               # before a commit: UserError if another run took the lease
    lease.release()                             # deletes the lease object (if it is still ours)
    with lease_for(objects, prefix) as lease:   # this process's lease on it, else one for this write only

An object store has no lock that dies with its holder, so the lease expires instead: it holds the
writer's pid, host, start time, a random token, how long it lasts (EXACTRESUME_S3_LEASE_SECONDS,
60 s by default) and a renewal count, and is rewritten by a thread every third of that and at each
check. A lease that has gone that long without a renewal (its holder was killed, or its machine
lost) may be taken by another run, and so may the lease of a holder on this host whose process is
gone, at once. Expiry never compares two machines' clocks: it is judged from the server's own clock
(the object's Last-Modified against the Date of the answer that read it, both the server's), or,
on a server that sends no Date, from the waiter's own monotonic clock, by the same object seen
unchanged for the lease's time. It is taken with a conditional PUT (If-None-Match when there is
none, If-Match on the expired one's ETag), so two runs racing for it never both win on a server that
honours them; on one that ignores them the lease read back after the PUT decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from exactresume.errors import MissingObject, StorageError, UserError
from exactresume.store.locations import S3Location
from exactresume.store.lock import describe_holder, holder_alive, wait_for_turn
from exactresume.store.s3.client import ObjectStore, WriteRaced

LEASE_NAME = ".exactresume.lease"
SECONDS_ENV = "EXACTRESUME_S3_LEASE_SECONDS"
DEFAULT_SECONDS = 60.0
POLL_SECONDS = 0.5
# HTTP dates are whole seconds: an age read as the difference of two of them may be a second short,
# so the server's clock calls a lease expired only once it is a second past its time.
DATE_SLACK = 1.0

_HELD: dict[str, S3Lease] = {}  # the leases this process holds, by prefix: what its other writers there check


def _lease_seconds() -> float:
    """How long a lease lasts without renewal: how long a killed holder keeps other runs out."""
    try:
        seconds = float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS))
    except ValueError:
        raise UserError(f"{SECONDS_ENV} must be a number of seconds, got {os.environ[SECONDS_ENV]!r}") from None
    if seconds <= 0:
        raise UserError(f"{SECONDS_ENV} must be above 0 seconds, got {seconds:g}")
    return seconds


@dataclass(frozen=True)
class Seen:
    """The lease object as one read found it: its holder ({} when none), its version (ETag and
    Last-Modified; None when none), and its age by the server's clock (None when it sends no Date)."""

    holder: dict
    version: tuple | None = None
    age: float | None = None

    @property
    def etag(self) -> str | None:
        return self.version[0] if self.version else None

    def seconds(self, default: float) -> float:
        """How long this lease lasts without renewal, as its holder stated it."""
        stated = self.holder.get("seconds")
        return float(stated) if isinstance(stated, (int, float)) and stated > 0 else default


class S3Lease:
    """The lease on one prefix, held from `acquire` until `release`, renewed meanwhile by a thread."""

    def __init__(self, objects: ObjectStore, folder: S3Location, seconds: float):
        self.objects, self.folder, self.seconds = objects, folder, seconds
        self.token, self.since, self.renewals, self.etag = secrets.token_hex(16), time.time(), 0, None
        self.lost: str | None = None  # why the lease is no longer ours, found by the renewing thread
        self.watched: tuple[tuple | None, float] | None = None  # another's lease as first seen, on our clock
        self.stopped = threading.Event()
        self.renewing: threading.Thread | None = None
        self.renewal = threading.Lock()  # the thread's renewal and a commit's must not race each other's If-Match

    @property
    def path(self) -> S3Location:
        return self.folder / LEASE_NAME

    @classmethod
    def acquire(
        cls, objects: ObjectStore, folder: S3Location, wait: float = 0.0, notify: Callable[[str], None] | None = None
    ) -> S3Lease:
        """Take the prefix's lease, waiting up to `wait` seconds for its holder to finish or its lease to expire.

        Raises UserError naming the holder when the lease stays taken."""
        lease = cls(objects, folder, _lease_seconds())

        def attempt() -> tuple[S3Lease | None, str]:
            seen = lease._take()
            if seen is not None:
                return None, lease._describe(seen)
            lease._start_renewing()
            _HELD[_key(folder)] = lease
            return lease, ""

        return wait_for_turn(attempt, wait, notify, POLL_SECONDS)  # each try is a request: fewer of them

    def _describe(self, seen: Seen) -> str:
        seconds = seen.seconds(self.seconds)
        if seen.age is not None:
            left = seconds + DATE_SLACK - seen.age
        else:
            left = seconds - (time.monotonic() - self.watched[1] if self.watched else 0.0)
        return (
            f"{describe_holder(self.folder, seen.holder)} (its lease expires in {max(0.0, left):.0f} s unless renewed)"
        )

    def _read(self) -> Seen:
        """The lease object as it is now; Seen({}) when there is none."""
        try:
            return self.objects.call(
                "get_object", f"GET {self.path}", _seen, Bucket=self.path.bucket, Key=self.path.key
            )
        except MissingObject:
            return Seen({})

    def _write(self, **condition: str) -> None:
        self.renewals += 1  # the body changes at each renewal, and so its ETag: a waiter sees the holder live
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self.since,
            "token": self.token,
            "seconds": self.seconds,
            "renewals": self.renewals,
        }
        body = json.dumps(holder).encode()
        answer = self.objects.call(
            "put_object", f"PUT {self.path}", Bucket=self.path.bucket, Key=self.path.key, Body=body, **condition
        )
        self.etag = answer.get("ETag")

    def _expired(self, seen: Seen) -> bool:
        """Whether another's lease has gone its time without a renewal: by the server's clock when it
        gives one, else by ours, counted from when we first saw this version of it."""
        seconds = seen.seconds(self.seconds)
        if seen.age is not None and seen.age > seconds + DATE_SLACK:
            return True
        now = time.monotonic()
        if self.watched is None or self.watched[0] != seen.version:
            self.watched = (seen.version, now)
        return now - self.watched[1] >= seconds

    def _take(self) -> Seen | None:
        """None when the lease is now ours, else the lease as it stands."""
        seen = self._read()
        mine = seen.holder.get("token") == self.token
        if seen.holder and not mine and not self._expired(seen) and holder_alive(seen.holder):
            return seen
        with contextlib.suppress(WriteRaced, MissingObject):  # another taker came first, or our retried PUT did
            self._write(**({"IfMatch": seen.etag} if seen.etag else {"IfNoneMatch": "*"}))
        seen = self._read()  # on a server that ignores the condition the last PUT wins
        return None if seen.holder.get("token") == self.token else seen

    def renew(self) -> None:
        """Extend the lease, or UserError naming the run that took it: this run must write nothing more."""
        with self.renewal:
            self._renew()

    def _renew(self) -> None:
        if self.lost is None:
            seen = self._read()
            if seen.holder.get("token") == self.token:
                with contextlib.suppress(WriteRaced, MissingObject):  # a retried PUT whose first try landed
                    self._write(**({"IfMatch": seen.etag} if seen.etag else {}))
                seen = self._read()
                if seen.holder.get("token") == self.token:
                    return
            holder = seen.holder
            self.lost = describe_holder(self.folder, holder) if holder else f"the lease on {self.folder} was deleted"
        raise UserError(
            f"this run lost its lease: {self.lost}; it stops before it writes or deletes anything more there"
        )

    check = renew  # a commit's check renews as it reads

    def _start_renewing(self) -> None:
        def renew_until_stopped() -> None:
            while not self.stopped.wait(self.seconds / 3):
                with contextlib.suppress(UserError, StorageError):  # found again by the next commit's check
                    self.renew()

        self.renewing = threading.Thread(target=renew_until_stopped, name="exactresume-s3-lease", daemon=True)
        self.renewing.start()

    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours."""
        self.stopped.set()
        if _HELD.get(_key(self.folder)) is self:
            del _HELD[_key(self.folder)]
        if self.lost is not None or self.objects.unreachable is not None:  # a dead store is not waited for again
            return
        with contextlib.suppress(UserError, StorageError):  # a lease left behind only expires
            if self._read().holder.get("token") == self.token:
                self.objects.delete([self.path])
        self.lost = "released"


def _seen(answer: dict) -> Seen:
    """A GET of the lease object as Seen: its age from its Last-Modified and the answer's Date, both the server's."""
    body, modified = answer["Body"].read(), answer.get("LastModified")
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    age = None
    with contextlib.suppress(TypeError, ValueError):
        age = (parsedate_to_datetime(date) - modified).total_seconds() if date and modified else None
    try:
        holder = json.loads(body)
    except ValueError:
        holder = {}  # not a lease we wrote: treated as expired
    return Seen(holder if isinstance(holder, dict) else {}, (answer.get("ETag"), modified), age)


def _key(folder: S3Location) -> str:
    return f"{folder.config.endpoint} {folder}"


@contextlib.contextmanager
def lease_for(objects: ObjectStore, folder: S3Location) -> Iterator[S3Lease]:
    """The lease this process holds on `folder` (its run's checkpoint store took it), else one taken
    for this write alone and released after it: every writer to a prefix checks the same lease."""
    held = _HELD.get(_key(folder))
    if held is not None:
        yield held
        return
    lease = S3Lease.acquire(objects, folder)
    try:
        yield lease
    finally:
        lease.release()
