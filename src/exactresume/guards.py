"""What a command checks before it writes a run folder: one writer per folder, and a run that fits.

lock_out(args, rank)   the lock on --out for the process that writes it (rank 0), or --wait-lock
check_plan(args)       refuse a train run whose memory or disk estimate does not fit (--force, --dry-run)
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from exactresume.atomic import ensure_writable_folder
from exactresume.errors import UserError
from exactresume.flags import config_from_args


def add_writer_flags(group, plan: bool = False) -> None:
    """--wait-lock for every command that writes a run folder; --force and --dry-run for train's plan."""
    group.add_argument(
        "--wait-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="if another process is writing --out, wait up to this long for it to finish (default: refuse at once)",
    )
    if plan:
        group.add_argument(
            "--force", action="store_true", help="start even when the memory or disk estimate says it will not fit"
        )
        group.add_argument("--dry-run", action="store_true", help="print the run's plan (parameters, memory, disk)")


def lock_out(args: argparse.Namespace, rank: int = 0):
    """The lock on --out for the process that writes it (rank 0); other ranks hold none."""
    from exactresume.store.lock import FolderLock

    if rank != 0:
        return contextlib.nullcontext()
    if args.wait_lock < 0:
        raise UserError(f"--wait-lock must be at least 0 seconds, got {args.wait_lock:g}")
    if args.wait_lock and args.command == "train" and args.resume != "auto":
        # Waiting is for a requeued job: it must continue from what the other left, not start over its log.
        raise UserError("--wait-lock needs --resume auto: after the wait the run continues from the newest checkpoint")
    notify = lambda message: print(f"exactresume {args.command}: {message}", file=sys.stderr, flush=True)
    return FolderLock.acquire(args.out, wait=args.wait_lock, notify=notify)


def check_plan(args: argparse.Namespace) -> bool:
    """Refuse a run that cannot fit, before any tensor exists; True when --dry-run printed the plan."""
    from exactresume.training.plan import data_vocab_size, plan_run, preflight

    plan = plan_run(
        config_from_args(args),
        args.nproc,
        args.save_every,
        args.keep or None,
        args.async_save,
        args.stop_at,
        vocab_size=data_vocab_size(args.data),
    )
    folder = args.out / "checkpoints" if args.save_every else args.out
    if args.dry_run:
        print("\n".join(plan.lines()))
    # The job's own check first, so a folder that cannot be made is named as that, not as a full disk.
    # A folder made for the check is removed again: the job makes it when it starts, and a refused or
    # planned-only run leaves nothing behind.
    made = not args.out.exists()
    ensure_writable_folder(args.out)
    try:
        preflight(plan, folder, force=args.force, retained=args.keep != 0, report=print if args.dry_run else None)
    finally:
        if made:
            with contextlib.suppress(OSError):
                args.out.rmdir()  # only while still empty
    return args.dry_run
