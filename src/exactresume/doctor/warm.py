"""How the doctor starts the command's processes: cold (a new process each run, as the user runs it),
or with `--warm`, forked from one process of the command's Python that imported torch once
(tracer/fork_server.py).

A warm run is still a new process that never saw the other runs; it only skips the seconds torch's
imports take, three times per doctor. It serves `PYTHON SCRIPT ARGS` and `PYTHON -m MODULE ARGS`;
any other command (torchrun, a console script, interpreter flags) starts cold as before.
"""

from __future__ import annotations

import atexit
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
TRACER_VARIABLES = "EXACTRESUME_DOCTOR_"  # a run's own: where its trace goes, when to cut it


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

    def __init__(self, pid: int, answers: queue.Queue, server: int):
        self.pid, self.answers, self.server = pid, answers, server

    def wait(self, timeout: float | None = None) -> int:
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        if answer is None:
            raise UserError("the doctor's fork server (--warm) ended during a run; run without --warm")
        return int(answer)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkServer:
    """The fork server of one Python and environment (tracer/fork_server.py), seen from here: runs
    started side by side, each answer routed to the run it names. Its output goes to `log`."""

    def __init__(self, python: str, env: dict[str, str], log: Path):
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as sink:
            self.process = subprocess.Popen(
                [python, str(FORK_SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, env=env
            )
        self.lock = threading.Lock()
        self.answers: dict[int, queue.Queue] = {0: queue.Queue()}  # 0: the server's own "ready"
        self.running = 0
        threading.Thread(target=self._read, daemon=True, name="doctor-fork-server").start()
        if self.answers[0].get() != "ready":
            raise UserError(f"the doctor's fork server (--warm) did not start; its output: {log}")

    def start(self, request: dict) -> WarmChild:
        with self.lock:
            number, self.running = len(self.answers), self.running + 1
            answers = self.answers[number] = queue.Queue()
            self.process.stdin.write((json.dumps(request | {"id": number}) + "\n").encode())
            self.process.stdin.flush()
        pid = answers.get()
        if pid is None:
            raise UserError(f"the doctor's fork server (--warm) did not start the run; its output: {self.log}")
        return WarmChild(int(pid), answers, self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def _read(self) -> None:
        for line in self.process.stdout:
            words = line.decode().split()
            if words == ["ready"]:
                self.answers[0].put("ready")
                continue
            with self.lock:  # "pid ID N" or "exit ID CODE"
                self.answers[int(words[1])].put(words[2])
                self.running -= words[0] == "exit"
        with self.lock:
            for answers in self.answers.values():
                answers.put(None)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# One server per Python and environment, for the life of this process: a process that runs the doctor
# many times (a test suite, a notebook) imports torch once per environment, not once per doctor run.
# Past MAX_SERVERS (each holds torch in memory) the oldest with no run going is closed.
MAX_SERVERS = 4
_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def _close_servers() -> None:
    while _servers:
        _servers.popitem()[1].close()


atexit.register(_close_servers)


def start_forked(python: str, env: dict[str, str], log: Path, request: dict) -> WarmChild:
    """`request` forked from the running server of `python` in `env` (less the tracer's variables: the
    server traces nothing), started with its output to `log` when there is none. Under the lock until
    the run has started, so that no other thread takes the server for idle and closes it meanwhile."""
    quiet = {k: v for k, v in env.items() if not k.startswith(TRACER_VARIABLES)}
    key = (shutil.which(python), tuple(sorted(quiet.items())))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            if key[0] is None:
                raise UserError(f"cannot start the command {python!r}: No such file or directory")
            server = _servers[key] = ForkServer(python, quiet, log)
            idle = [k for k, other in _servers.items() if other.running == 0 and k != key]
            for old in idle[: max(0, len(_servers) - MAX_SERVERS)]:
                _servers.pop(old).close()
        return server.start(request)


class Launcher:
    """Starts each run cold, or, with `warm`, forked from the fork server of the command's Python."""

    def __init__(self, warm: bool, logs: Path):
        self.warm, self.logs = warm, logs

    def start(self, command: list[str], env: dict[str, str], log: Path, sink):
        request = forkable(command) if self.warm and hasattr(os, "fork") else None
        if request is None:
            return start_cold(command, env, log, sink)
        request |= {"env": env, "cwd": os.getcwd(), "log": str(log)}
        return start_forked(command[0], env, self.logs / "fork-server.log", request)
