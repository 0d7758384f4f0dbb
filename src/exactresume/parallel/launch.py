"""`--nproc N`: start the same command in N processes through PyTorch's own launcher (torchrun).

    exactresume train ... --nproc 2
    = python -m torch.distributed.run --standalone --nproc-per-node 2 -m exactresume.cli -- train ... --nproc 2

Each process finds its rank in the environment torchrun sets (world.World.from_env) and
ignores --nproc. This file does not import torch, so the process that only launches stays light.
A user's mistake is met by every rank alike; the launcher prints it once, as one line, with the
rank's exit code (2, or 74 for a disk that refused a write), instead of torchrun's failure report.

Preemption: torchrun runs in its own session, and a SIGTERM or SIGINT to this process is passed on
to it, as is a SIGTERM when this process dies (kill -9 included); torchrun passes it to every rank
once, the ranks agree to stop after the same step, save, and exit 75, which the launcher returns. A
signal sent to every process at once (the ranks included, as some schedulers do) reaches the ranks
twice, and a second signal stops a rank without saving.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
from collections.abc import Collection, Iterator

# The line every rank prints for a user's mistake or an interrupt (cli.main).
ERROR_LINE = re.compile(r"^exactresume \w+: (error: .*|interrupted|stopped by .* after step \d+.*)$")
# torchrun's failure report names the first failed rank's exit code.
EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
PREEMPTED_EXIT = 75  # preemption.PREEMPTED_EXIT (that module is not imported here)
# DDP's note that find_unused_parameters found none: we set it on purpose (replicas.Replicas).
EXPECTED_NOTE = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"


def launch_command(argv: Collection[str], nproc: int) -> list[str]:
    """`exactresume ARGV` under PyTorch's launcher with N processes on this machine."""
    # `--` keeps torchrun's parser off our flags: it takes --log and --nproc for ambiguous prefixes of its own.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "exactresume.cli",
        "--",
        *argv,
    ]


def first_error(stderr: str) -> str | None:
    """The first of the ranks' one-line errors in the launcher's stderr, if any rank printed one."""
    return next((line for line in stderr.splitlines() if ERROR_LINE.match(line)), None)


def launch(argv: Collection[str], nproc: int) -> int:
    """Run `exactresume ARGV` in N processes under torchrun; a rank's one line and exit code when one fails."""
    env = dict(os.environ)
    # torchrun would set 1 and warn; split this machine's cores between the processes instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Its own session: a terminal's Ctrl-C reaches the ranks once, through torchrun, not twice. And a
    # SIGTERM when this process dies (kill -9 included): the ranks save and stop, none is left behind.
    process = subprocess.Popen(
        launch_command(argv, nproc),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_terminated_with_parent,
    )
    with _passing_signals_to(process):
        _, stderr = process.communicate()
    error = first_error(stderr) if process.returncode else None
    if error is None:
        sys.stderr.writelines(line for line in stderr.splitlines(keepends=True) if EXPECTED_NOTE not in line)
        return process.returncode
    print(error, file=sys.stderr)
    return exit_code(error, stderr)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _terminated_with_parent() -> None:
    """In torchrun's process, before it starts: SIGTERM when the launcher dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_code(line: str, stderr: str) -> int:
    """The exit code a single process would have returned for the ranks' `line`."""
    if line.endswith("interrupted"):
        return 130
    if ": stopped by " in line:
        return PREEMPTED_EXIT
    reported = EXIT_CODE.search(stderr)
    return 74 if reported and int(reported.group(1)) == 74 else 2


@contextlib.contextmanager
def _passing_signals_to(process: subprocess.Popen) -> Iterator[None]:
    """Pass SIGTERM and SIGINT on to `process` (torchrun) while it runs, instead of dying first."""
    numbers = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, lambda number, frame: process.send_signal(number)) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
