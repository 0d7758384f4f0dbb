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

The server is one per process, like multiprocessing's fork server: it reads one request per line on
its stdin, answers with the run's exit status on its stdout, and exits when its stdin closes.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

CLI_MODULE = "exactresume.cli"
PRELOAD = ("exactresume.training.job_run", "torch._dynamo")

_server: subprocess.Popen | None = None


def start_server() -> None:
    """Start the server (it imports PRELOAD in the background) unless it runs already."""
    global _server
    if not hasattr(os, "fork") or (_server is not None and _server.poll() is None):
        return
    _server = subprocess.Popen(
        [sys.executable, "-m", "exactresume.lab.warm_start"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    atexit.register(stop_server)


def stop_server() -> None:
    """Close the server's stdin (it exits) and wait for it."""
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait()
        _server.stdout.close()
        _server = None


def run_cli(argv: list[str], env: dict[str, str] | None = None, environ: bool = False) -> subprocess.CompletedProcess:
    """`exactresume ARGV` in a new process: its exit code (negative: killed by that signal) and output.

    `env`: variables the new process sees beside the environment the server was started with, or,
    with `environ`, beside this process's environment as it is now (what a cold start would see).
    """
    start_server()
    if _server is None:
        command = [sys.executable, "-m", CLI_MODULE, *argv]
        return subprocess.run(command, capture_output=True, text=True, env=os.environ | (env or {}))
    with tempfile.TemporaryDirectory(prefix="exactresume-run-") as folder:
        stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
        request = {"argv": list(argv), "stdout": str(stdout), "stderr": str(stderr), "env": env or {}}
        if environ:
            request["environ"] = dict(os.environ)
        _server.stdin.write(json.dumps(request) + "\n")
        reply = _server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the warm-start server exited (status {_server.wait()})")
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""
        return subprocess.CompletedProcess(argv, int(reply), read(stdout), read(stderr))


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
    """The server: import PRELOAD, then fork one child per request line and report its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the lab and the run, not for us
    for module in PRELOAD:
        __import__(module)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"{os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()
    os._exit(0)  # nothing to clean up, and tearing torch down takes seconds


if __name__ == "__main__":
    serve()
