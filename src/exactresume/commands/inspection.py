"""`exactresume inspect`: what a checkpoint is (kind, step, config, parts, sizes), verified.

exactresume inspect runs/a/resume.pth      exit 1 when a folder or prefix holds a damaged checkpoint
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from exactresume.commands.output import emit
from exactresume.commands.places import add_s3_flags, any_location, check_endpoint_used, given_path, place
from exactresume.errors import UserError


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        type=any_location,
        help="a resume or weights file, an export, a checkpoint folder or a sharded one (or s3://)",
    )
    add_s3_flags(parser)
    parser.add_argument(
        "--local-checkpoints",
        type=given_path,
        metavar="DIR",
        help="PATH is a two-tier run's checkpoint folder: list its local tier too, and say which a resume takes",
    )
    parser.add_argument("--json", action="store_true", help="print the facts as JSON, for scripts")


def run(args: argparse.Namespace) -> int:
    from exactresume.store.contents import format_inspection, inspect_checkpoint, inspect_tiers

    check_endpoint_used(args, args.path)
    if args.local_checkpoints is not None:
        _check_two_tiers(args.path, args.local_checkpoints)
        info = inspect_tiers(place(args.path, args), args.local_checkpoints)
    else:
        info = inspect_checkpoint(place(args.path, args))
    emit(args, info, lambda info: [format_inspection(info)], gap=False)
    # A folder or prefix listed with a damaged checkpoint in it: a script checking a store must not read "all well".
    return 1 if info["kind"] in ("store", "tiers") and info["checksum"] != "verified" else 0


def _check_two_tiers(path: Path | str, local: Path) -> None:
    """UserError when the local tier named is PATH itself: its checkpoints would be listed as both tiers'."""
    if isinstance(path, Path) and os.path.abspath(path) == os.path.abspath(local):
        raise UserError(
            f"--local-checkpoints {local} is PATH itself: give the run's local tier, or inspect {path} alone"
        )
