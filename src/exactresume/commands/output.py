"""What every command prints: progress (--progress, --quiet), and its closing summary (--json).

Every command ends with `emit`: its closing summary (summaries.py) as aligned text, or with `--json`
as one JSON object on stdout, which then holds nothing else (`summary_stdout`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable

from exactresume.progress import MODES, resolve_mode


def add_output_flags(group, progress: bool = True, summary_json: bool = True) -> None:
    """--progress and --quiet (only errors), and --json: the closing summary as one JSON object (not both:
    one asks for the summary, the other for none)."""
    if progress:
        group.add_argument(
            "--progress",
            choices=MODES,
            default="auto",
            help="auto: a bar on a terminal, plain periodic lines otherwise",
        )
    one_of = group.add_mutually_exclusive_group()
    one_of.add_argument(
        "--quiet",
        action="store_true",
        help="print only errors: no progress, no summary" if progress else "print only errors",
    )
    if summary_json:
        one_of.add_argument(
            "--json", action="store_true", help="end with the summary as one JSON object on stdout (no progress)"
        )


def progress_mode(args: argparse.Namespace) -> str:
    """`none` with --quiet, and with --json, whose stdout holds only the summary."""
    return "none" if args.quiet or getattr(args, "json", False) else resolve_mode(args.progress)


@contextlib.contextmanager
def summary_stdout(args: argparse.Namespace):
    """--quiet: nothing on stdout. --json: stdout holds only the summary; what else a command prints goes to stderr."""
    args.summary_stream = sys.stdout
    if getattr(args, "quiet", False):
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    elif getattr(args, "json", False):
        with contextlib.redirect_stdout(sys.stderr):
            yield
    else:
        yield


def emit(args: argparse.Namespace, summary: dict, render: Callable[[dict], list[str]], gap: bool = True) -> None:
    """The command's closing summary on the real stdout (main sends everything else elsewhere under --json)."""
    if getattr(args, "quiet", False) or getattr(args, "no_summary", False):
        return
    stream = getattr(args, "summary_stream", None) or sys.stdout
    if getattr(args, "json", False):
        print(json.dumps(summary, indent=2), file=stream, flush=True)
        return
    text = "\n".join(render(summary))
    print(("\n" if gap else "") + text, file=stream, flush=True)
