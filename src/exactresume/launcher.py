"""`--nproc N`: start the same command in N processes through PyTorch's own launcher (torchrun).

    exactresume train ... --nproc 2
    = python -m torch.distributed.run --standalone --nproc-per-node 2 -m exactresume.cli -- train ... --nproc 2

Each process finds its rank in the environment torchrun sets (distributed.World.from_env) and
ignores --nproc. This file does not import torch, so the process that only launches stays light.
A user's mistake is met by every rank alike; the launcher prints it once, as one line, exit 2,
instead of torchrun's failure report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Collection

from .errors import UserError

# The line every rank prints for a user's mistake or an interrupt (cli.main).
ERROR_LINE = re.compile(r"^exactresume \w+: (error: .*|interrupted)$")
# DDP's note that find_unused_parameters found none: we set it on purpose (distributed.Replicas).
EXPECTED_NOTE = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_batch_split(batch: int, nproc: int) -> None:
    """Refuse a global batch that N processes cannot share evenly."""
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if batch % nproc:
        raise UserError(f"--batch {batch} is not divisible by {nproc} processes; the global batch is split evenly")


def launch_command(argv: Collection[str], nproc: int) -> list[str]:
    """`exactresume ARGV` under PyTorch's launcher with N processes on this machine."""
    # `--` keeps torchrun's parser off our flags: it takes --log and --nproc for ambiguous prefixes of its own.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "exactresume.cli", "--", *argv]


def first_error(stderr: str) -> str | None:
    """The first of the ranks' one-line errors in the launcher's stderr, if any rank printed one."""
    return next((line for line in stderr.splitlines() if ERROR_LINE.match(line)), None)


def launch(argv: Collection[str], nproc: int) -> int:
    """Run `exactresume ARGV` in N processes under torchrun; 2 and one line on stderr for a user's mistake."""
    env = dict(os.environ)
    # torchrun would set 1 and warn; split this machine's cores between the processes instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    finished = subprocess.run(launch_command(argv, nproc), stderr=subprocess.PIPE, text=True, env=env)
    error = first_error(finished.stderr) if finished.returncode else None
    if error is None:
        sys.stderr.writelines(line for line in finished.stderr.splitlines(keepends=True) if EXPECTED_NOTE not in line)
        return finished.returncode
    print(error, file=sys.stderr)
    return 130 if error.endswith("interrupted") else 2
