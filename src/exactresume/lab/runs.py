"""The lab's training runs: `exactresume train ...` in new processes, each forked from a server that
has imported what a run needs (forkserver/), so that a run starts in a fraction of a second.

The command is `python -m exactresume`, the package's own entry point (__main__.py): the command a
user types, not a module of a layer above this one.
"""

from __future__ import annotations

import os
import subprocess
import sys

from exactresume.forkserver.client import Run, ServerKind, spawn, start_server

# What a run needs imported: training and torch._dynamo (building any torch optimizer imports it),
# and where the s3 extra installed boto3, what a run to or from s3:// imports.
TRAINING_RUNS = ServerKind(
    preload=("exactresume.training.job_run", "torch._dynamo"),
    optional=("boto3", "botocore.config", "exactresume.store.s3.prefix", "exactresume.store.s3.sharded"),
)


def start_runs_server() -> None:
    """Start the server of training runs now, so that its imports overlap with the caller's own."""
    start_server(sys.executable, TRAINING_RUNS)


def spawn_cli(argv: list[str], env: dict[str, str] | None = None) -> Run:
    """`exactresume ARGV` in a new process, not waited for; `env` beside this process's environment."""
    return spawn([sys.executable, "-m", "exactresume", *map(str, argv)], os.environ | (env or {}), kind=TRAINING_RUNS)


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`exactresume ARGV` in a new process, waited for: its exit code and output."""
    run = spawn_cli(argv, env)
    stdout, stderr = run.communicate()
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
