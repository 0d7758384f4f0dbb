"""What a command checks before it writes a run folder: one writer per folder, and a run that fits.

lock_out(args, rank)   the lock on --out for the process that writes it (rank 0), or --wait-lock
check_plan(config, args) a train run's plan; one whose memory or disk estimate does not fit is refused
remove_made_folder(out)  after a refused run: the --out folder it made, while nothing was written there
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from exactresume.atomic import ensure_writable_folder
from exactresume.errors import UserError


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


def lock_out(args: argparse.Namespace, rank: int = 0):
    """The lock on --out for the process that writes it (rank 0); other ranks hold none (the lab and the
    ablation; a train job takes its own, training/job_run.py)."""
    from exactresume.store.lock import FolderLock

    if rank != 0:
        return contextlib.nullcontext()
    if args.wait_lock < 0:
        raise UserError(f"--wait-lock must be at least 0 seconds, got {args.wait_lock:g}")
    notify = lambda message: print(f"exactresume {args.command}: {message}", file=sys.stderr, flush=True)
    return FolderLock.acquire(args.out, wait=args.wait_lock, notify=notify)


def check_plan(config, args: argparse.Namespace):
    """The plan of a run of `config` (printed with --dry-run); a run that cannot fit is refused before
    torch is imported."""
    from exactresume.training.plan import data_vocab_size, plan_run, preflight

    keep = args.keep or None
    plan = plan_run(
        config, args.nproc, args.save_every, keep, args.async_save, args.stop_at, vocab_size=data_vocab_size(args.data)
    )
    if args.dry_run:
        print("\n".join(plan.lines()))
    # OUT first, so that a folder that cannot be made is named as that, not as a full disk. The job
    # writes into the folder made here; a refused or planned-only run leaves nothing behind.
    made = not args.out.exists()
    ensure_writable_folder(args.out)
    folder = args.out / "checkpoints" if args.save_every else args.out
    try:
        preflight(plan, folder, force=args.force, retained=args.keep != 0, report=print if args.dry_run else None)
    except UserError:
        _remove_if_empty(args.out, made)
        raise
    if args.dry_run:
        _remove_if_empty(args.out, made)
    return plan


def remove_made_folder(out) -> None:
    """Remove `out` and the empty folders under it (checkpoints/), as long as no file is there: a run
    refused before its first step leaves nothing behind. Only for a folder the command itself made."""
    for folder in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _remove_if_empty(folder, True)
    _remove_if_empty(out, True)


def _remove_if_empty(folder, made: bool) -> None:
    if made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only while still empty
