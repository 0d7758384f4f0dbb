"""One writer per folder: an exclusive OS lock on FOLDER/.exactresume.lock while a process writes.

    with FolderLock.acquire("runs/a"):       # or UserError: "runs/a is being written by pid 1234 ..."
        ...                                  # write the folder
    FolderLock.acquire("runs/a", wait=60)    # a requeued job: wait up to 60 s for the holder to finish

The lock is `fcntl.flock` on the lock file, so the kernel drops it when the holding process dies,
kill -9 included: there is never a stale lock to clear by hand. The file holds the holder's pid,
host, start time and a random token, for the message a refused writer prints; a clean release
deletes it (while still locked), and an acquirer checks that the file it locked is still the one
at the path, so a release racing with an acquire never lets two writers in.

flock conflicts between two opens of the file even in one process, so a second writer in the same
process is refused too. A process that starts other processes to write the folder for it (the lab
starting `exactresume train`) hands them its token in EXACTRESUME_HELD_LOCKS (`share_with_children`); a child
whose folder is locked by a *different* process holding one of those tokens writes under that lock.
Readers (diff, inspect, export, a resume from another folder) take no lock and never wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exactresume.errors import StorageError, UserError

LOCK_NAME = ".exactresume.lock"
HELD_ENV = "EXACTRESUME_HELD_LOCKS"  # tokens of the locks held by the processes that started us
POLL_SECONDS = 0.1


class FolderLock:
    """An exclusive lock on one folder, held from `acquire` until `release` (or the process's end)."""

    def __init__(self, folder: Path, fd: int | None, token: str):
        self.folder, self.fd, self.token, self.shared = folder, fd, token, False
        self.pid = os.getpid()  # a forked child (a DataLoader worker) shares the lock but must not delete it

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    @classmethod
    def acquire(cls, folder: Path | str, wait: float = 0.0, notify: Callable[[str], None] | None = None) -> FolderLock:
        """Lock `folder` (created if needed), waiting up to `wait` seconds for another writer to finish.

        Raises UserError naming the holder when the folder stays locked.
        """
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if folder.exists() and not folder.is_dir():
                raise UserError(f"output folder {folder} is a file, not a folder") from None
            raise UserError(f"cannot create output folder {folder}: {error.strerror}") from None

        def attempt() -> tuple[FolderLock | None, str]:
            lock = cls._try(folder)
            if lock is not None:
                return lock, ""
            holder = _holder_once_written(folder / LOCK_NAME)
            if not holder:  # the holder let go while we looked (its file is gone): the lock may be free now
                lock = cls._try(folder)
                if lock is not None:
                    return lock, ""
                holder = _holder_once_written(folder / LOCK_NAME)
            if holder.get("token") in _inherited_tokens() and holder.get("pid") != os.getpid():
                return cls(folder, None, str(holder["token"])), ""  # our parent's lock: we write for it
            return None, describe_holder(folder, holder)

        return wait_for_turn(attempt, wait, notify)

    @classmethod
    def _try(cls, folder: Path) -> FolderLock | None:
        """The lock if it is free now, else None."""
        path = folder / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:  # what to do depends on what the lock was for: its taker's to say (disk.py)
            raise StorageError.from_os_error(f"the lock file of {folder}", error) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not _same_file(fd, path):  # the holder released and deleted it between our open and flock
            os.close(fd)
            return cls._try(folder)
        lock = cls(folder, fd, secrets.token_hex(16))
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": lock.token}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return lock

    @property
    def held(self) -> bool:
        return self.fd is not None

    def share_with_children(self) -> None:
        """Let the processes we start from now on write the folder under this lock (until `release`)."""
        _hand_down(_inherited_tokens() | {self.token})
        self.shared = True

    def release(self) -> None:
        """Delete the lock file and unlock; a lock handed down from a parent is left to the parent."""
        if self.shared:
            self.shared = False
            _hand_down(_inherited_tokens() - {self.token})
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            if os.getpid() == self.pid and _same_file(fd, self.path):
                self.path.unlink()
        os.close(fd)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def held_lock_env() -> dict[str, str]:
    """The lock tokens this process shares with its children, for a child started another way."""
    return {HELD_ENV: os.environ[HELD_ENV]} if os.environ.get(HELD_ENV) else {}


def _inherited_tokens() -> set[str]:
    return {token for token in os.environ.get(HELD_ENV, "").split(",") if token}


def _hand_down(tokens: set[str]) -> None:
    """The tokens the processes we start inherit; none: the variable gone, the environment as it was."""
    if tokens:
        os.environ[HELD_ENV] = ",".join(sorted(tokens))
    else:
        os.environ.pop(HELD_ENV, None)


def wait_for_turn(
    attempt: Callable[[], tuple[Any, str]],
    wait: float,
    notify: Callable[[str], None] | None,
    poll: float = POLL_SECONDS,
):
    """What `attempt()` takes, trying again for up to `wait` seconds: one writer at a time, for a folder's
    lock as for an object store prefix's lease. `attempt` returns what it took, or None and who holds it;
    UserError naming the holder when the time is up, `notify` told once when the wait begins."""
    deadline, told = time.monotonic() + wait, False
    while True:
        taken, holder = attempt()
        if taken is not None:
            return taken
        if time.monotonic() >= deadline:
            raise UserError(f"{holder}; wait for it or stop it")
        if notify and not told:
            notify(f"{holder}; waiting up to {wait:g} s for it to finish")
            told = True
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def _holder_once_written(path: Path, tries: int = 20) -> dict:
    """`read_holder`, read again for a moment while the file is empty: a holder writes it just after it
    takes the lock, and a refusal should name it."""
    holder = read_holder(path)
    for _ in range(tries):
        if holder:
            break
        time.sleep(0.01)
        holder = read_holder(path)
    return holder


def read_holder(path: Path) -> dict:
    """What the lock file says about its holder; empty while it is being written."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(folder: Path, holder: dict) -> str:
    """'runs/x is being written by pid 1234 on host h since 07:01:22'."""
    if "pid" not in holder:
        return f"{folder} is being written by another process"
    since = time.localtime(float(holder.get("since", 0)))
    today = time.localtime().tm_yday == since.tm_yday and time.localtime().tm_year == since.tm_year
    when = time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S", since)
    mine = " (this process: another store of it on the folder, to close first)" if holder["pid"] == os.getpid() else ""
    return f"{folder} is being written by pid {holder['pid']}{mine} on host {holder.get('host', '?')} since {when}"


def holder_alive(holder: dict) -> bool:
    """Whether the holder a lock file or a lease names may still be writing: one on this host whose process
    is gone (killed) is not, so its lease is taken at once; one on another host is taken to be."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
