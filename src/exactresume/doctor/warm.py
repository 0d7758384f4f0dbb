"""How the doctor starts the command's processes: cold (a new process each run, as the user runs it),
or with `--warm`, forked from a fork server (forkserver/) of the command's Python that imported torch
and loaded the tracer once.

A warm run is still a new process that never saw the other runs; it only skips the seconds torch's
imports take, three times per doctor. It serves `PYTHON SCRIPT ARGS` and `PYTHON -m MODULE ARGS`;
any other command (torchrun, a console script, interpreter flags) starts cold as before.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exactresume.forkserver.client import Run, ServerKind, spawn

TRACER = Path(__file__).resolve().parent / "tracer"
# What the server of the command's Python loads before it forks: the tracer (under the shim's private
# name), torch, and torch._dynamo (which building any optimizer imports); nothing else of the user's but
# the modules `--preload` names (its framework), whose imports would otherwise be paid by every run.
TRACED_KIND = ServerKind(optional=("torch", "torch._dynamo"), tracer=TRACER)
TRACER_VARIABLES = "EXACTRESUME_DOCTOR_"  # a run's own: where its trace goes, when to cut it


class Launcher:
    """Starts each run cold, or, with `warm`, forked from the fork server of the command's Python and
    environment (less the tracer's variables: the server traces nothing), which also imported `preload`."""

    def __init__(self, warm: bool, logs: Path, preload: tuple[str, ...] = ()):
        self.warm, self.logs = warm, logs
        self.kind = replace(TRACED_KIND, preload=preload)

    def start(self, command: list[str], env: dict[str, str], log: Path) -> Run:
        """The run, its output (stdout and stderr together) in `log`, which starts empty."""
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")
        quiet = {name: value for name, value in env.items() if not name.startswith(TRACER_VARIABLES)}
        return spawn(command, env, log, self.kind, quiet, self.logs / "fork-server.log", fork=self.warm)
