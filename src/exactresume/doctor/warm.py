"""How the doctor starts the command's processes: cold (a new process each run, as the user runs it),
or with `--warm`, forked from a fork server (forkserver/) of the command's Python that imported torch
and loaded the tracer once.

A warm run is still a new process that never saw the other runs; it only skips the seconds torch's
imports take, three times per doctor. It serves `PYTHON SCRIPT ARGS` and `PYTHON -m MODULE ARGS`;
any other command (torchrun, a console script, interpreter flags) starts cold as before.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from exactresume.errors import UserError
from exactresume.forkserver.client import ServerKind, forkable, spawn

TRACER = Path(__file__).resolve().parent / "tracer"
# What the server of the command's Python loads before it forks: the tracer (under the shim's private
# name), torch, and torch._dynamo (which building any optimizer imports); nothing else of the user's.
TRACED_KIND = ServerKind(optional=("torch", "torch._dynamo"), tracer=TRACER)
TRACER_VARIABLES = "EXACTRESUME_DOCTOR_"  # a run's own: where its trace goes, when to cut it


def start_cold(command: list[str], env: dict[str, str], sink) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    except OSError as error:
        raise UserError(f"cannot start the command {command[0]!r}: {error.strerror}") from error


class Launcher:
    """Starts each run cold, or, with `warm`, forked from the fork server of the command's Python and
    environment (less the tracer's variables: the server traces nothing)."""

    def __init__(self, warm: bool, logs: Path):
        self.warm, self.logs = warm, logs

    def start(self, command: list[str], env: dict[str, str], log: Path, sink):
        if not (self.warm and forkable(command)):
            return start_cold(command, env, sink)
        quiet = {name: value for name, value in env.items() if not name.startswith(TRACER_VARIABLES)}
        return spawn(command, env, log, TRACED_KIND, server_env=quiet, server_log=self.logs / "fork-server.log")
