"""Runs forked from a fork server (serve.py), or started cold where they cannot be, as Popen-like handles.

    run = spawn([sys.executable, "-m", "exactresume", "train", ...], kind=ServerKind(preload=("torch",)))
    run.wait(); stdout, stderr = run.output()          # pid, poll, wait, send_signal, kill, communicate

One server per Python, preload and tracer (and, where given, server environment), for the life of this
process: a process that starts many runs (the lab, a test suite, the doctor in a notebook) imports
torch once per kind. Past MAX_SERVERS (each holds torch in memory) the oldest with no run going is
closed. `python SCRIPT ARGS` and `python -m MODULE ARGS` are forked; any other command (torchrun, a
console script, interpreter flags), and any command where there is no fork (Windows), starts cold.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from exactresume.errors import UserError

SERVE = Path(__file__).resolve().with_name("serve.py")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
MAX_SERVERS = 4


@dataclass(frozen=True)
class ServerKind:
    """What a server imports before it forks: modules every run needs, modules where installed, the
    doctor's tracer package (its folder)."""

    preload: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    tracer: Path | None = None

    def flags(self) -> list[str]:
        flags = ["--preload", ",".join(self.preload), "--preload-optional", ",".join(self.optional)]
        return flags + (["--tracer", str(self.tracer)] if self.tracer else [])


class ServerGone(UserError):
    """The fork server ended while a run was starting or going."""


def forkable(command: list[str]) -> dict | None:
    """What a server runs for `command` (its argv, or module and argv), or None where it cannot."""
    if not hasattr(os, "fork") or len(command) < 2 or not PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    if command[1] == "-m" and len(command) > 2:
        return {"module": command[2], "argv": command[2:]}
    return None if command[1].startswith("-") else {"argv": command[1:]}


class Run:
    """One run, handled as a subprocess.Popen is: forked (`answers` brings its exit code) or cold (`popen`).
    Its stdout and stderr are files; `output()` reads them while it runs."""

    def __init__(self, args: list[str], stdout: Path, stderr: Path | None):
        self.args, self.stdout_path, self.stderr_path = args, stdout, stderr
        self.returncode: int | None = None
        self.pid, self.popen, self.answers, self.server = 0, None, None, None

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (negative: the signal that ended it); subprocess.TimeoutExpired after `timeout`."""
        if self.returncode is None:
            if self.popen is not None:
                self.returncode = self.popen.wait(timeout)
            else:
                try:
                    code = self.answers.get(timeout=timeout)
                except queue.Empty:
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                if code is None:
                    raise ServerGone(
                        f"the fork server (pid {self.server}) ended during the run of {shlex.join(self.args)} "
                        f"(pid {self.pid}); rerun it, or start it without the server"
                    )
                self.returncode = int(code)
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal_number)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def output(self) -> tuple[str, str]:
        """What it wrote to stdout and to stderr so far (both in stdout when they share a file)."""
        read = lambda path: path.read_text(errors="replace") if path is not None and path.exists() else ""
        return read(self.stdout_path), read(self.stderr_path)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()


class ForkServer:
    """A running serve.py, seen from here: runs started side by side, each answer routed to the run it names."""

    def __init__(self, python: str, kind: ServerKind, env: dict[str, str], log: Path, own_folder: bool = False):
        self.log, self.own_folder = log, own_folder  # own_folder: the log's folder was made for it alone
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as sink:
            self.process = subprocess.Popen(
                [python, str(SERVE), *kind.flags()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, env=env
            )
        self.lock = threading.Lock()
        self.answers: dict[int, queue.Queue] = {0: queue.Queue()}  # 0: the server's own "ready"
        self.running, self.ready = 0, False
        # Not waited for here: the server imports while the caller goes on with its own imports.
        threading.Thread(target=self._read, daemon=True, name="exactresume-fork-server").start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, run: Run, request: dict) -> Run:
        if not self.ready:
            if self.answers[0].get() != "ready":
                raise ServerGone(f"the fork server did not start ({self._last_words()}); its output: {self.log}")
            self.ready = True
        with self.lock:
            number, self.running = len(self.answers), self.running + 1
            answers = self.answers[number] = queue.Queue()
            self.process.stdin.write((json.dumps(request | {"id": number}) + "\n").encode())
            self.process.stdin.flush()
        pid = answers.get()
        if pid is None:
            raise ServerGone(f"the fork server did not start {shlex.join(run.args)}; its output: {self.log}")
        run.pid, run.answers, run.server = int(pid), answers, self.process.pid
        return run

    def _last_words(self) -> str:
        """The last line it wrote: the error that ended it (a module it could not import, say)."""
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"it exited {self.process.wait()}"

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
        if self.process.wait() == 0 and self.own_folder:  # a server that failed keeps its log to be read
            shutil.rmtree(self.log.parent, ignore_errors=True)


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def _close_servers() -> None:
    """Close every server (they exit when their stdin closes); the next run starts a new one."""
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


atexit.register(_close_servers)


def _server_for(python: str, kind: ServerKind, server_env: dict[str, str] | None, log: Path | None) -> ForkServer:
    """The running server of `python` and `kind` (and `server_env`, when given), started when there is none."""
    resolved = shutil.which(python)
    if resolved is None:
        raise UserError(f"cannot start the command {python!r}: No such file or directory")
    key = (resolved, kind, None if server_env is None else tuple(sorted(server_env.items())))
    server = _servers.get(key)
    if server is None or not server.alive:
        own_folder = log is None
        log = log or Path(tempfile.mkdtemp(prefix="exactresume-fork-server-")) / "server.log"
        env = dict(os.environ if server_env is None else server_env)
        server = _servers[key] = ForkServer(python, kind, env, log, own_folder)
        idle = [k for k, other in _servers.items() if other.running == 0 and k != key]
        for old in idle[: max(0, len(_servers) - MAX_SERVERS)]:
            _servers.pop(old).close()
    return server


def start_server(python: str, kind: ServerKind) -> None:
    """Start the server of `python` and `kind` now, so that its imports overlap with the caller's own."""
    if hasattr(os, "fork"):
        with _servers_lock:
            _server_for(python, kind, None, None)


def spawn(
    command: list[str],
    env: dict[str, str] | None = None,
    log: Path | None = None,
    kind: ServerKind = ServerKind(),
    server_env: dict[str, str] | None = None,
    server_log: Path | None = None,
    fork: bool = True,
) -> Run:
    """`command` in a new process with environment `env` (default: this one's), forked from the server of
    its Python and `kind` where it can be (and `fork` asks for it), else started cold. Output: into `log`
    (stdout and stderr together, appended), or without one into two files of its own, removed with the
    handle. `server_env`: the environment the server itself runs in (and is kept apart by); default this
    process's at its start."""
    env = dict(os.environ if env is None else env)
    run = _run_with_files(command, log)
    request = forkable(command) if fork else None
    if request is None:
        return _start_cold(run, command, env)
    request |= {"env": env, "cwd": os.getcwd(), "stdout": str(run.stdout_path)}
    request |= {"stderr": str(run.stderr_path)} if run.stderr_path else {}
    # Under the lock until the run has started, so that no other thread takes the server for idle and closes it.
    with _servers_lock:
        return _server_for(command[0], kind, server_env, server_log).start(run, request)


def _run_with_files(command: list[str], log: Path | None) -> Run:
    if log is not None:
        return Run(command, log, None)
    folder = Path(tempfile.mkdtemp(prefix="exactresume-run-"))
    run = Run(command, folder / "stdout", folder / "stderr")
    weakref.finalize(run, shutil.rmtree, folder, True)
    return run


def _start_cold(run: Run, command: list[str], env: dict[str, str]) -> Run:
    with open(run.stdout_path, "ab") as stdout:
        stderr = open(run.stderr_path, "ab") if run.stderr_path else subprocess.STDOUT
        try:
            run.popen = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
        except OSError as error:
            raise UserError(f"cannot start the command {command[0]!r}: {error.strerror}") from error
        finally:
            if run.stderr_path:
                stderr.close()
    run.pid = run.popen.pid
    return run
