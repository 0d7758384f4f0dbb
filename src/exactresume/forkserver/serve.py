"""The fork server: a process of the runs' own Python imports what they need once, then forks each run.

Run as a script by that interpreter, importing nothing of exactresume (the doctor's server runs in the
user's Python, which may not have it):

    PYTHON serve.py [--preload M,M] [--preload-optional M,M] [--tracer FOLDER]

One request per line on stdin, one answer per line on stdout:

    in   {"id": 3, "argv": ["train.py", "--out", "ckpt"], "env": {...}, "cwd": "...", "stdout": PATH, "stderr": PATH}
         ("module": "exactresume" runs `python -m` that module; "stderr" absent: into stdout's file)
    out  "ready" once its imports are done; "pid ID N" when run ID started; "exit ID CODE" when it ended
         (CODE negative: the signal that ended it)

Several runs may go at once; the server exits when its stdin closes, killing the runs still going
(their caller ended, or was killed: nothing of theirs is written after it). A run is what `PYTHON ARGV...`
would be after its start: its own environment, folder, argv, sys.path[0] and fresh random seeds,
output at the descriptor level (C++ output too), the doctor's tracer started from its environment
when the server loaded one (--tracer), the program run as __main__, and at its exit its threads
waited for, then its atexit handlers.
The server never builds a model or draws a random number, so every run starts from the same state.
"""

import argparse
import atexit
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import sys
import tempfile
import threading
import traceback

TRACER_NAME = "_exactresume_doctor_tracer"  # the private name the tracer's shim loads it under
REAP_INTERVAL_S = 0.02  # how often the server looks for ended children while some run


def _load_tracer(folder: str):
    """The tracer package from `folder`, under the shim's private name; its `install` module."""
    if TRACER_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            TRACER_NAME, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[TRACER_NAME] = package
        spec.loader.exec_module(package)
    return importlib.import_module(TRACER_NAME + ".install")


def _redirect(stdout: str, stderr: str | None) -> None:
    """stdin from /dev/null, stdout and stderr into their files at the descriptor level."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if stderr is None:
        os.dup2(1, 2)
        return
    opened = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(opened, 2)
    os.close(opened)


def _fresh_entropy() -> None:
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


def _start_tracer(tracer, preloaded: list[str]) -> None:
    """The tracer started from the run's environment, its wrappers bound in the `preloaded` modules too;
    where this Python could not load it (`tracer` is that error), the run ends as the tracer's shim ends
    it, saying why."""
    try:
        if isinstance(tracer, BaseException):
            raise tracer
        tracer.start_from_environment(preloaded)
    except Exception as error:
        sys.modules[TRACER_NAME].not_started(error)


def _become_run(request: dict, tracer, preloaded: list[str]) -> None:
    """In the forked child: become the run, run it, exit with its code. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        atexit._clear()  # the server's handlers are not the run's
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from the run's own TMPDIR, as a new process finds it
        os.chdir(request.get("cwd") or os.getcwd())
        _redirect(request["stdout"], request.get("stderr"))
        sys.argv = list(request["argv"])
        _fresh_entropy()
        if tracer is not None:
            _start_tracer(tracer, preloaded)
        code = _run_program(request)
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
        if not isinstance(ended.code, int | None):
            print(ended.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # its threads end first, as at an interpreter's exit (a save in flight, say)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run_program(request: dict) -> int:
    """`python -m MODULE` or `python SCRIPT`, as __main__; 0 when it returns without exiting."""
    if "module" in request:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


def preload(flags: argparse.Namespace) -> tuple:
    """Import what every run needs; the tracer (or the error that kept it from loading), and the modules
    `--preload` brought in beyond those (the user's framework, for the doctor: the tracer's wrappers are
    bound in them as each run starts)."""
    tracer = None
    if flags.tracer:
        try:
            tracer = _load_tracer(flags.tracer)
        except Exception as error:  # this Python has no torch, say: each run says so, as a cold one would
            tracer = error
    for module in filter(None, flags.preload_optional.split(",")):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    before = set(sys.modules)
    for module in filter(None, flags.preload.split(",")):
        importlib.import_module(module)
    return tracer, sorted(set(sys.modules) - before)


def serve(flags: argparse.Namespace) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller and the runs
    loaded = preload(flags)
    os.write(1, b"ready\n")
    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], REAP_INTERVAL_S if running else None)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the caller closed it: it ended, or was killed
                _end_runs(running)
                os._exit(0)  # nothing else to clean up, and tearing torch down takes seconds
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                start(json.loads(line), loaded, running)
        _reap(running)


def start(request: dict, loaded: tuple, running: dict[int, int]) -> None:
    pid = os.fork()
    if pid == 0:
        _become_run(request, *loaded)
    running[pid] = request["id"]
    os.write(1, f"pid {request['id']} {pid}\n".encode())  # unbuffered: nothing held across a fork


def _end_runs(running: dict[int, int]) -> None:
    """Kill the runs still going and reap them: nobody is left to hear how they end, and none of them
    may go on writing once the process that started it is gone."""
    for pid in running:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in running:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _reap(running: dict[int, int]) -> None:
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        os.write(1, f"exit {running.pop(pid)} {os.waitstatus_to_exitcode(status)}\n".encode())


def _parse_flags() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fork each run from one process that imported its modules once")
    parser.add_argument("--preload", default="", help="modules every run imports, comma-separated")
    parser.add_argument("--preload-optional", default="", help="modules imported where installed")
    parser.add_argument("--tracer", help="the doctor's tracer package folder, started in every run")
    return parser.parse_args()


if __name__ == "__main__":
    del sys.path[0]  # this folder: its modules are not top-level names for a run to find
    serve(_parse_flags())
