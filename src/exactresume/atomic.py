"""Atomic, durable file writes: a reader sees the old file or the new one, never half of either.

The bytes go to `PATH.tmp`, are flushed and fsynced, the temporary file is renamed over `PATH` with
`os.replace`, and the folder is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

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


def fsync_folder(folder: Path) -> None:
    """Make a rename or unlink inside `folder` durable."""
    fsync_path(folder)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on `PATH.tmp`, then make it durable and rename it over `path`."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_folder(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    atomic_write(path, lambda file: file.write(data))


def ensure_writable_folder(folder: Path) -> Path:
    """Create `folder` if needed and check we may write there, or raise a one-line UserError."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create output folder {folder}: {error.strerror}") from None
    if not folder.is_dir():
        raise UserError(f"output path {folder} is not a folder")
    # A real probe, not os.access: root passes access checks even on read-only file systems.
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise UserError(f"output folder {folder} is not writable: {error.strerror}") from None
    return folder


def write_json(path: Path, values: dict) -> None:
    """`values` as indented JSON, written atomically."""
    atomic_write_bytes(path, (json.dumps(values, indent=2) + "\n").encode())
