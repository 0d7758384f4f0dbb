"""One writer per prefix: a lease object, PREFIX/.exactresume.lease, held while a run writes the prefix.

    lease = S3Lease.acquire(objects, prefix)   # or UserError: "s3://b/run is being written by pid 1234 ..."
    lease.check()                               # before a commit: UserError if another run took the lease
    lease.release()                             # deletes the lease object (if it is still ours)

An object store has no lock that dies with its holder, so the lease expires instead: it holds the
writer's pid, host, start time, a random token and a wall-clock expiry (EXACTRESUME_S3_LEASE_SECONDS,
60 s by default), renewed by a thread every third of that and at each check. A lease past its expiry
(its holder was killed, or its machine lost) may be taken by another run, and so may the lease of a
holder on this host whose process is gone, at once. It is taken with a conditional PUT (If-None-Match
when there is none, If-Match on the expired one's ETag), so two runs racing for it never both win
on a server that honours them; on one that ignores them the lease read back after the PUT decides.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from exactresume.errors import MissingObject, StorageError, UserError
from exactresume.store.locations import S3Location
from exactresume.store.lock import describe_holder
from exactresume.store.s3 import ObjectStore, WriteRaced

LEASE_NAME = ".exactresume.lease"
SECONDS_ENV = "EXACTRESUME_S3_LEASE_SECONDS"
DEFAULT_SECONDS = 60.0
POLL_SECONDS = 0.5


def lease_seconds() -> float:
    """How long a lease lasts without renewal: how long a killed holder keeps other runs out."""
    try:
        seconds = float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS))
    except ValueError:
        raise UserError(f"{SECONDS_ENV} must be a number of seconds, got {os.environ[SECONDS_ENV]!r}") from None
    if seconds <= 0:
        raise UserError(f"{SECONDS_ENV} must be above 0 seconds, got {seconds:g}")
    return seconds


class S3Lease:
    """The lease on one prefix, held from `acquire` until `release`, renewed meanwhile by a thread."""

    def __init__(self, objects: ObjectStore, folder: S3Location, seconds: float):
        self.objects, self.folder, self.seconds = objects, folder, seconds
        self.token, self.since, self.etag = secrets.token_hex(16), time.time(), None
        self.lost: str | None = None  # why the lease is no longer ours, found by the renewing thread
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
        lease, deadline, told = cls(objects, folder, lease_seconds()), time.monotonic() + wait, False
        while True:
            holder = lease._take()
            if holder is None:
                lease._start_renewing()
                return lease
            if time.monotonic() >= deadline:
                raise UserError(f"{lease._describe(holder)}; wait for it or stop it")
            if notify and not told:
                notify(f"{lease._describe(holder)}; waiting up to {wait:g} s for it to finish")
                told = True
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    def _describe(self, holder: dict) -> str:
        left = max(0.0, float(holder.get("expires", 0)) - time.time())
        return f"{describe_holder(self.folder, holder)} (its lease expires in {left:.0f} s unless renewed)"

    def _read(self) -> tuple[dict, str | None]:
        """The lease object's holder and ETag; ({}, None) when there is none."""
        try:
            body, etag = self.objects.call(
                "get_object",
                f"GET {self.path}",
                lambda answer: (answer["Body"].read(), answer.get("ETag")),
                Bucket=self.path.bucket,
                Key=self.path.key,
            )
        except MissingObject:
            return {}, None
        try:
            holder = json.loads(body)
        except ValueError:
            holder = {}  # not a lease we wrote: treated as expired
        return (holder if isinstance(holder, dict) else {}), etag

    def _write(self, **condition: str) -> None:
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self.since,
            "token": self.token,
            "expires": time.time() + self.seconds,
        }
        body = json.dumps(holder).encode()
        answer = self.objects.call(
            "put_object", f"PUT {self.path}", Bucket=self.path.bucket, Key=self.path.key, Body=body, **condition
        )
        self.etag = answer.get("ETag")

    def _take(self) -> dict | None:
        """None when the lease is now ours, else its holder."""
        holder, etag = self._read()
        if holder.get("token") != self.token and float(holder.get("expires", 0)) > time.time() and alive(holder):
            return holder
        with contextlib.suppress(WriteRaced, MissingObject):  # another taker came first, or our retried PUT did
            self._write(**({"IfMatch": etag} if etag else {"IfNoneMatch": "*"}))
        holder, _ = self._read()  # on a server that ignores the condition the last PUT wins
        return None if holder.get("token") == self.token else holder

    def renew(self) -> None:
        """Extend the lease, or UserError naming the run that took it: this run must write nothing more."""
        with self.renewal:
            self._renew()

    def _renew(self) -> None:
        if self.lost is None:
            holder, etag = self._read()
            if holder.get("token") == self.token:
                with contextlib.suppress(WriteRaced, MissingObject):  # a retried PUT whose first try landed
                    self._write(**({"IfMatch": etag} if etag else {}))
                holder = self._read()[0]
                if holder.get("token") == self.token:
                    return
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
        if self.lost is not None or self.objects.unreachable is not None:  # a dead store is not waited for again
            return
        with contextlib.suppress(UserError, StorageError):  # a lease left behind only expires
            if self._read()[0].get("token") == self.token:
                self.objects.delete([self.path])
        self.lost = "released"


def alive(holder: dict) -> bool:
    """Whether the holder may still be writing: a holder on this host whose process is gone (killed) is not,
    so its lease is taken at once; one on another host is trusted until its lease expires."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
