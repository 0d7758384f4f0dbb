"""How the doctor starts the command's processes: cold (a new process each run, as the user runs it),
or with `--warm`, forked from one process of the command's Python that imported torch once
(tracer/fork_server.py).

A warm run is still a new process that never saw the other runs; it only skips the seconds torch's
imports take, three times per doctor. It serves `PYTHON SCRIPT ARGS` and `PYTHON -m MODULE ARGS`;
any other command (torchrun, a console script, interpreter flags) starts cold as before.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from exactresume.errors import UserError

FORK_SERVER = Path(__file__).resolve().parent / "tracer" / "fork_server.py"
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def start_cold(command: list[str], env: dict[str, str], log: Path, sink) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    except OSError as error:
        raise UserError(f"cannot start the command {command[0]!r}: {error.strerror}") from error


def forkable(command: list[str]) -> dict | None:
    """What the fork server runs for `command` (its argv, or module and argv), or None where it cannot."""
    if len(command) < 2 or not PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    if command[1] == "-m" and len(command) > 2:
        return {"module": command[2], "argv": command[2:]}
    return None if command[1].startswith("-") else {"argv": command[1:]}


class WarmChild:
    """One forked run, waited on and killed as a subprocess.Popen is."""

    def __init__(self, pid: int, answers: queue.Queue):
        self.pid, self.answers = pid, answers

    def wait(self, timeout: float | None = None) -> int:
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        if answer is None:
            raise UserError("the doctor's fork server (--warm) ended during a run; run without --warm")
        return int(answer.removeprefix("exit "))

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Launcher:
    """Starts each run cold, or, with `warm`, from the fork server of the command's Python (started once)."""

    def __init__(self, warm: bool, logs: Path):
        self.warm, self.logs = warm, logs
        self.server: subprocess.Popen | None = None
        self.answers: queue.Queue = queue.Queue()

    def start(self, command: list[str], env: dict[str, str], log: Path, sink):
        request = forkable(command) if self.warm and hasattr(os, "fork") else None
        if request is None:
            return start_cold(command, env, log, sink)
        self._serve(command[0], env)
        self.server.stdin.write(json.dumps(request | {"env": env, "cwd": os.getcwd(), "log": str(log)}) + "\n")
        self.server.stdin.flush()
        answer = self.answers.get()
        if answer is None or not answer.startswith("pid "):
            raise UserError(f"the doctor's fork server (--warm) did not start the run; its output: {self._log}")
        return WarmChild(int(answer.removeprefix("pid ")), self.answers)

    @property
    def _log(self) -> Path:
        return self.logs / "fork-server.log"

    def _serve(self, python: str, env: dict[str, str]) -> None:
        if self.server is not None:
            return
        if shutil.which(python) is None:
            raise UserError(f"cannot start the command {python!r}: No such file or directory")
        quiet = {k: v for k, v in env.items() if k != "EXACTRESUME_DOCTOR_TRACE"}  # the server traces nothing
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "wb") as log:
            self.server = subprocess.Popen(
                [python, str(FORK_SERVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=quiet,
            )
        threading.Thread(target=self._read, daemon=True, name="doctor-fork-server").start()
        if self.answers.get() != "ready":
            raise UserError(f"the doctor's fork server (--warm) did not start; its output: {self._log}")

    def _read(self) -> None:
        for line in self.server.stdout:
            self.answers.put(line.strip())
        self.answers.put(None)

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait()
            self.server = None

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
