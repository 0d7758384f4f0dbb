"""`exactresume doctor --warm`: the command's Python imports torch once, then forks each run from itself.

Run as a script by the command's own interpreter (`PYTHON fork_server.py`), with the environment the
runs get less the tracer's own variables: it loads the tracer from this folder under the private name
the shim uses, imports torch (and torch._dynamo, which building any optimizer imports) and nothing
else of the user's, then reads one request per line on stdin:

    {"id": 3, "argv": ["train.py", "--out", "ckpt"], "env": {...}, "cwd": "...", "log": "..."}   (or "module": ...)

It forks, answers "pid ID N" (ID: the request's "id"), and when that child ends "exit ID CODE"
(negative: the signal that ended it); several children may run at once, and it exits when its stdin
closes. One server serves every doctor run of a process that uses the same Python and environment.
The child is what `PYTHON train.py ...` would be after its start: its own environment, folder,
argv and sys.path[0], output to the log, the tracer started from the environment (before the script
imports anything more, as the shim starts it), the script run as __main__, atexit handlers at exit.
The server never builds a model or draws a random number, so each run starts from the same state.
"""

import atexit
import importlib.util
import json
import os
import runpy
import select
import signal
import sys
import traceback

NAME = "_exactresume_doctor_tracer"
PRELOAD = ("torch", "torch._dynamo")
REAP_INTERVAL_S = 0.02  # how often the server looks for ended children while some run


def load_tracer():
    """The tracer package from this file's folder, under the shim's private name (once per process)."""
    if NAME not in sys.modules:
        folder = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            NAME, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = package
        spec.loader.exec_module(package)
    return importlib.import_module(NAME + ".install")


def redirect(log: str) -> None:
    """stdin from /dev/null, stdout and stderr into the log, at the descriptor level (C++ output too)."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.dup2(1, 2)


def fresh_entropy() -> None:
    """Seed from the OS what a new process seeds from it (python's, numpy's and torch's CPU global RNGs):
    a fork would otherwise start every run from the server's seeds. CUDA's generators start from a
    fixed seed in a new process, and the server never initializes CUDA."""
    modules = sys.modules
    if "random" in modules:
        modules["random"].seed()
    if "numpy" in modules:
        modules["numpy"].random.seed()
    if "torch" in modules:
        modules["torch"].default_generator.seed()


def start_tracer(install) -> None:
    """The tracer started from the run's environment; where it cannot start in this Python (the server
    could not load it: `install` is that error), the run ends as the shim ends it, saying why."""
    try:
        if isinstance(install, BaseException):
            raise install
        install.start_from_environment()
    except Exception as error:
        sys.modules[NAME].not_started(error)


def run_child(request: dict, install) -> None:
    """In the forked child: become the command's process, run it, exit with its code. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()  # the server's handlers are not the run's
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        redirect(request["log"])
        sys.argv = list(request["argv"])
        fresh_entropy()
        start_tracer(install)
        if "module" in request:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
        if not isinstance(ended.code, int | None):
            print(ended.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the doctor and the run
    try:
        install = load_tracer()
    except Exception as error:  # this Python has no torch, say: each run says so, as a cold one would
        install = error
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    os.write(1, b"ready\n")
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
                start(json.loads(line), install, running)
        reap(running)


def start(request: dict, install, running: dict[int, int]) -> None:
    pid = os.fork()
    if pid == 0:
        run_child(request, install)
    running[pid] = request["id"]
    os.write(1, f"pid {request['id']} {pid}\n".encode())  # unbuffered: nothing held across a fork


def reap(running: dict[int, int]) -> None:
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        os.write(1, f"exit {running.pop(pid)} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    del sys.path[0]  # this folder: its modules are the tracer's, not top-level names for torch to find
    serve()
