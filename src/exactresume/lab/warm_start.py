"""New processes for the lab's training runs, forked from a warm server instead of started cold.

Each `exactresume train` the lab runs is a new process: a resume is only proven in a process that
never saw the run before. Started cold, each would import torch, and torch._dynamo (which building
any torch optimizer imports): seconds per process, more than the default lab's training. A small
server process imports them once and forks each run from itself: a new process, with its own PID
and memory, that starts with those modules imported and nothing else (the server never builds a
model, runs an operator or draws a random number). Where there is no fork (Windows), runs start
cold with subprocess.

    start_server()                     # early: its imports overlap with the caller's own
    run_cli(["train", "--out", ...])   # like subprocess.run([..., "exactresume", ...], capture_output=True)
    run = WarmProcess(["train", ...])  # like subprocess.Popen: pid, send_signal, poll, wait, communicate

The server is one per process, like multiprocessing's fork server: it reads one request per line on
its stdin, forks, answers "started ID PID" on its stdout, and "ended ID CODE" once that child ended
(several may run at once); it exits when its stdin closes. Its replies are read by one thread here,
which hands each to the run it names.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from pathlib import Path

CLI_MODULE = "exactresume.cli"
PRELOAD = ("exactresume.training.job_run", "torch._dynamo")
# What a run to or from s3:// imports (a third of a second), where the s3 extra installed boto3.
PRELOAD_IF_INSTALLED = ("boto3", "botocore.config", "exactresume.store.s3_folder", "exactresume.store.s3_sharded")
REAP_INTERVAL_S = 0.02  # how often the server looks for ended children while some run


class _Server:
    """The server process, seen from here: `fork(request)` starts a run; its replies reach the run's queue."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exactresume.lab.warm_start"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.replies: dict[int, queue.Queue] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="exactresume-warm-start").start()

    def fork(self, request: dict) -> tuple[int, queue.Queue]:
        """Send `request`; the new run's pid and the queue its exit code will arrive on."""
        with self.lock:
            number = len(self.replies)
            replies = self.replies[number] = queue.Queue()
            self.process.stdin.write((json.dumps(request | {"id": number}) + "\n").encode())
            self.process.stdin.flush()
        reply = replies.get()
        if reply is None:
            raise RuntimeError(f"the warm-start server exited (status {self.process.wait()})")
        return reply, replies

    def _read(self) -> None:
        for line in self.process.stdout:
            _, number, value = line.split()
            self.replies[int(number)].put(int(value))
        with self.lock:
            for replies in self.replies.values():
                replies.put(None)

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait()


_server: _Server | None = None


def start_server() -> None:
    """Start the server (it imports PRELOAD in the background) unless it runs already."""
    global _server
    if not hasattr(os, "fork") or (_server is not None and _server.process.poll() is None):
        return
    _server = _Server()
    atexit.register(stop_server)


def stop_server() -> None:
    """Close the server's stdin (it exits) and wait for it."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


class WarmProcess:
    """`exactresume ARGV` in a new process, handled as a subprocess.Popen is (pid, send_signal, poll,
    wait, communicate): forked from the server, or started cold where there is no fork. Its stdout
    and stderr go to two files of its own, read with `output()` while it runs, removed with it.

    `env`: variables the new process sees beside the environment the server was started with, or,
    with `environ`, beside this process's environment as it is now (what a cold start would see).
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, environ: bool = False):
        self.argv, self.returncode = list(argv), None
        folder = Path(tempfile.mkdtemp(prefix="exactresume-run-"))
        weakref.finalize(self, shutil.rmtree, folder, True)
        self.stdout_path, self.stderr_path = folder / "stdout", folder / "stderr"
        start_server()
        if _server is None:
            with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr:
                command = [sys.executable, "-m", CLI_MODULE, *self.argv]
                self._cold = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=os.environ | (env or {}))
            self.pid = self._cold.pid
            return
        request = {"argv": self.argv, "stdout": str(self.stdout_path), "stderr": str(self.stderr_path)}
        request |= {"env": env or {}} | ({"environ": dict(os.environ)} if environ else {})
        self._cold, (self.pid, self._ended) = None, _server.fork(request)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (negative: the signal that ended it); subprocess.TimeoutExpired after `timeout`."""
        if self.returncode is None:
            if self._cold is not None:
                self.returncode = self._cold.wait(timeout)
            else:
                try:
                    code = self._ended.get(timeout=timeout)
                except queue.Empty:
                    raise subprocess.TimeoutExpired(self.argv, timeout) from None
                if code is None:
                    raise RuntimeError("the warm-start server exited during a run")
                self.returncode = code
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """What it wrote to stdout and stderr so far."""
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""
        return read(self.stdout_path), read(self.stderr_path)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()


def run_cli(argv: list[str], env: dict[str, str] | None = None, environ: bool = False) -> subprocess.CompletedProcess:
    """`exactresume ARGV` in a new process (a WarmProcess), waited for: its exit code and output."""
    run = WarmProcess(argv, env, environ)
    stdout, stderr = run.communicate()
    return subprocess.CompletedProcess(argv, run.returncode, stdout, stderr)


def _run_child(request: dict) -> None:
    """In the forked child: output to the request's files, run the CLI, exit. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if "environ" in request:
            os.environ.clear()
            os.environ.update(request["environ"])
        os.environ.update(request.get("env", {}))
        # The request pipe is the server's, not ours; output goes to the files at the descriptor
        # level, so that C++ output is captured too.
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        # The child is `python -m exactresume.cli ARGV` without the start-up: it names the command line
        # by module, like the cold path does, since this layer sits below the CLI it starts.
        code = importlib.import_module(CLI_MODULE).main(request["argv"])
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The server: import PRELOAD, then fork one child per request line; report each start and end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the lab and the run, not for us
    for module in PRELOAD:
        __import__(module)
    for module in PRELOAD_IF_INSTALLED:
        try:
            __import__(module)
        except ImportError:
            pass
    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], REAP_INTERVAL_S if running else None)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                os._exit(0)  # nothing to clean up, and tearing torch down takes seconds
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _start(json.loads(line), running)
        _reap(running)


def _start(request: dict, running: dict[int, int]) -> None:
    pid = os.fork()
    if pid == 0:
        _run_child(request)
    running[pid] = request["id"]
    os.write(1, f"started {request['id']} {pid}\n".encode())  # unbuffered: nothing held across a fork


def _reap(running: dict[int, int]) -> None:
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        os.write(1, f"ended {running.pop(pid)} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve()
