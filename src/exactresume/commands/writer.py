"""One writer per run folder: the lock on --out, --wait-lock, and leaving nothing behind when refused.

    lock = lock_out("lab", out, wait)   the lock on OUT for the process that writes it, or one line naming the holder
    remove_made_folder(out)             after a refused run: the --out folder it made, while nothing was written there

A train job takes its own lock (training/job_run.py); the lab and the ablation take theirs here.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from exactresume.config import check_wait_lock


def add_writer_flags(group, plan: bool = False) -> None:
    """--wait-lock for every command that writes a run folder; --force and --dry-run for train's plan."""
    group.add_argument(
        "--wait-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="if another process is writing --out (or train's s3:// --checkpoints prefix: a killed writer's lease "
        "lasts 60 s), wait up to this long for it to finish (default: refuse at once)",
    )
    if plan:
        group.add_argument(
            "--force", action="store_true", help="start even when the memory or disk estimate says it will not fit"
        )
        group.add_argument("--dry-run", action="store_true", help="print the run's plan (parameters, memory, disk)")


def lock_out(command: str, out: Path, wait: float):
    """The lock on `out`, waiting up to `wait` seconds for another writer; released at the process's end."""
    from exactresume.store.lock import FolderLock

    check_wait_lock(wait)
    notify = lambda message: print(f"exactresume {command}: {message}", file=sys.stderr, flush=True)
    return FolderLock.acquire(out, wait=wait, notify=notify)


def first_missing(out: Path) -> Path | None:
    """The outermost folder of `out`'s path that does not exist yet (what making `out` makes), or None."""
    missing = [place for place in (out, *out.parents) if not place.exists()]
    return missing[-1] if missing else None


def remove_made_folder(out: Path) -> None:
    """Remove `out` and the empty folders under it (checkpoints/), as long as no file is there: a run
    refused before its first step leaves nothing behind. Only for a folder the command itself made
    (`first_missing` before it made it: the parents it made with it go too)."""
    for folder in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only while still empty
    with contextlib.suppress(OSError):
        out.rmdir()
