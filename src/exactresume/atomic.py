"""Atomic, durable file writes: a reader sees the old file or the new one, never half of either.

The bytes go to `PATH.tmp`, are flushed and fsynced, the temporary file is renamed over `PATH` with
`os.replace`, and the folder is fsynced so the rename itself survives a power cut. The temporary file
is held with an exclusive flock while it is written: a second process writing the same path at the
same moment is refused, rather than writing into the same temporary file and publishing mixed bytes.

A folder of files is written elsewhere, each file made durable (`fsync_tree`), and put at its name in
one rename (`replace_folder`), over the old folder where there is one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from exactresume.errors import UserError

TMP_SUFFIX = ".tmp"


def tmp_path(path: Path) -> Path:
    """The temporary name a write to `path` goes through."""
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_path(path: Path) -> None:
    """fsync a file or folder by name (for a folder: makes a rename or unlink inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Stage = Callable[[str], None]


def atomic_write(
    path: Path, write: Callable[[BinaryIO], None], stage: Stage | None = None, expected_bytes: int = 0
) -> None:
    """Call `write(file)` on `PATH.tmp`, then make it durable and rename it over `path`.

    `stage(name)`, when given, is called as the write reaches each of its stages, so a fault can be
    injected there (store/faults.py): "write" once half of `expected_bytes` are out, then "fsync",
    "rename" and, once renamed, "folder-fsync". Whatever fails before the rename, no `.tmp` remains.
    """
    path = Path(path)
    tmp = tmp_path(path)
    raw = _open_alone(path, tmp)
    try:  # the file stays open, and so locked, until it is renamed or removed
        write_through(_WatchedFile(raw, stage, expected_bytes), write)
        _reach(stage, "fsync")
        raw.flush()
        os.fsync(raw.fileno())
        _reach(stage, "rename")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        raw.close()
    _reach(stage, "folder-fsync")
    fsync_path(path.parent)


def write_through(file: Any, write: Callable[[Any], None]) -> None:
    """`write(file)`, raising the first error `file` recorded (its `error`) rather than what a writer such
    as torch.save makes of it (torch.save wraps a file's error in one of its own)."""
    try:
        write(file)
    except Exception:
        if file.error is not None:
            raise file.error from None
        raise


def _open_alone(path: Path, tmp: Path) -> BinaryIO:
    """`tmp`, empty, readable too (a sealed write hashes its file back), and held by this process alone."""
    while True:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"{path} is being written by another process at this moment: one process writes a file "
                "(under torchrun, give every rank world=World.from_env(), and rank 0 writes)"
            ) from None
        if _still_named(fd, tmp):
            os.ftruncate(fd, 0)  # a leftover of a killed write, or nothing
            return os.fdopen(fd, "w+b")
        os.close(fd)  # the other writer renamed it into place between our open and our lock: open anew


def _still_named(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _reach(stage: Stage | None, name: str) -> None:
    if stage is not None:
        stage(name)


class _WatchedFile:
    """The temporary file as `write` sees it: reports the "write" stage halfway, keeps the first OSError.

    torch.save turns an OSError raised by `write` into a RuntimeError about zip positions; the
    OSError is raised instead, so a full disk is reported as what it is.
    """

    def __init__(self, file: BinaryIO, stage: Stage | None, expected_bytes: int):
        self.file, self.stage, self.written = file, stage, 0
        self.halfway = expected_bytes // 2 if stage is not None else -1  # -1: never
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            count = self.file.write(data)
            before, self.written = self.written, self.written + count
            if before < self.halfway <= self.written or before == 0 and self.halfway == 0:
                self.file.flush()  # a kill here must leave a real half-written file behind
                _reach(self.stage, "write")
        except OSError as error:
            self.error = self.error or error
            raise
        return count

    def __getattr__(self, name: str):  # seek, flush, tell: the file's own
        return getattr(self.file, name)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    atomic_write(path, lambda file: file.write(data))


def ensure_writable_folder(folder: Path, what: str = "output folder") -> Path:
    """Create `folder` if needed and check we may write there, or raise a one-line UserError naming it as `what`."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{what} {folder} is a file, not a folder") from None
        raise UserError(f"cannot create {what} {folder}: {error.strerror}") from None
    # A real probe, not os.access: root passes access checks even on read-only file systems.
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise UserError(f"{what} {folder} is not writable: {error.strerror}") from None
    return folder


def write_json(path: Path, values: dict) -> None:
    """`values` as indented JSON, written atomically."""
    atomic_write_bytes(path, (json.dumps(values, indent=2) + "\n").encode())


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, and `folder`: what a rename of it publishes is then durable."""
    for path in sorted(folder.rglob("*"), reverse=True):  # the deepest first, each folder after what it holds
        fsync_path(path)
    fsync_path(folder)


def empty_tmp_folder(path: Path) -> Path:
    """`PATH.tmp/`, made anew and empty (what an interrupted write of folder `path` left there removed)."""
    staging = tmp_path(path)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def replace_folder(new: Path, target: Path) -> None:
    """Put folder `new` at `target` in one rename: a reader sees the old folder or the new one."""
    if not target.exists():
        os.rename(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # it now holds the old folder
    else:  # no atomic exchange on this system: move the old folder aside for the instant of the rename
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old)
    fsync_path(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    at_fdcwd, rename_exchange = -100, 2
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
