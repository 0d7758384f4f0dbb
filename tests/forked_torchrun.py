"""`torchrun --standalone --nproc-per-node N SCRIPT ARGS`, for the tests' runs by hand, with the ranks
forked from this process rather than started cold:

    python tests/forked_torchrun.py N SCRIPT ARGS

The ranks run under PyTorch's elastic agent (the engine torchrun runs, through exactresume's own
`--nproc` agent), with the environment torchrun gives them (RANK, WORLD_SIZE, MASTER_ADDR, ...), and
each runs SCRIPT as `python SCRIPT` would. Started from a fork server that imported a framework, a rank
begins with it imported: a cold rank pays torch's and the framework's imports again (3 to 4 CPU-seconds
each). test_distributed.py holds that forked ranks end as torchrun's cold ones do.
"""

from __future__ import annotations

import os
import random
import runpy
import sys
import tempfile
from pathlib import Path

import torch

from exactresume.parallel.agent import run_agent


def run_script(argv: list[str]) -> int:
    """One rank: SCRIPT run as __main__, with its folder first on the path as `python SCRIPT` puts it, and
    the global RNGs seeded from the OS as a new process seeds them (a fork would share this one's)."""
    random.seed()
    torch.default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    leave_at_once, os._exit = os._exit, _leave  # the agent waits for each rank's return: leaving at once hangs it
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as leaving:
        if leaving.code:
            raise
    finally:
        os._exit = leave_at_once  # multiprocessing ends the rank with it once this returns
    return 0


def _leave(code: int) -> None:
    """A script's os._exit(CODE) (a cold rank's way past gloo's teardown), as sys.exit(CODE): a forked rank
    returns to the agent, then ends with os._exit of its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="exactresume-ranks-", ignore_cleanup_errors=True) as files:
        code = run_agent(run_script, sys.argv[2:], int(sys.argv[1]), Path(files))
    sys.exit(code)
