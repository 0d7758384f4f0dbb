"""What the tests share besides fixtures: commands run in this process or in a new one, the shared
reference run, and the assertions every exactness claim makes (torch.equal, one-line errors)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from exactresume.cli import main
from exactresume.doctor.run import SHIM_DIR
from exactresume.doctor.warm import TRACED_KIND
from exactresume.forkserver import client as forkserver
from exactresume.lab import runs

# Small runs keep the suite fast; exactness does not depend on size.
MOTO_SECRET = "moto-secret-never-printed"  # the secret key conftest.moto_s3 sets: no message may show it

SMALL = ["--steps", "8", "--batch", "2", "--seq-len", "16", "--preset", "tiny"]

# Twelve short paragraphs: 246 training tokens, so 15 samples of 16 tokens. With --batch 4 an
# epoch is 4 steps (4, 4, 4 and a short last batch of 3), and 8 steps cross an epoch boundary.
TINY_TEXT = "\n\n".join(f"In the beginning {i} was the word, and the word was {i * 7 % 13}." for i in range(12))


def once_per_session(tmp_path_factory, name: str, compute: Callable[[Path], dict]) -> dict:
    """`compute(folder)` once for the whole session, however many xdist workers share it: the first
    worker to ask computes it, the others wait and read its JSON (pytest-xdist's own recipe)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    answer = root / f"{name}.json"
    with FileLock(f"{answer}.lock"):
        if not answer.exists():
            (root / name).mkdir(exist_ok=True)
            answer.write_text(json.dumps(compute(root / name)))
        return json.loads(answer.read_text())


def call_cli(*args: object) -> subprocess.CompletedProcess:
    """`exactresume ARGS` in this process: fast, for claims about refusals, not about exactness."""
    out, err = io.StringIO(), io.StringIO()
    with stable_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit:
            code = exit.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_cli(*args: object, check: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`exactresume ARGS` in a new process (exactness claims need one that never saw the run), with this
    process's environment and `env`: forked from the server of `exactresume` runs (forkserver/), which
    imported torch once, so that a test pays for a process, not for torch's imports again."""
    with stable_environ():
        finished = runs.run_cli(list(args), env=env)
    if check and finished.returncode != 0:
        raise AssertionError(f"exactresume {' '.join(map(str, args))} exited {finished.returncode}:\n{finished.stderr}")
    return finished


def train_cli(
    out: Path, *flags: object, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`exactresume train --out OUT FLAGS` in a new process (run_cli)."""
    return run_cli("train", "--out", out, *flags, check=check, env=env)


def spawn_cli(*args: object, env: dict[str, str] | None = None) -> forkserver.Run:
    """`exactresume ARGS` started in a new process as run_cli starts it, not waited for: a handle like
    subprocess.Popen's (pid, send_signal, poll, wait, communicate), for a test that stops or kills it."""
    with stable_environ():
        return runs.spawn_cli(list(args), env=env)


def printed(process: forkserver.Run, needle: str, timeout: float = 120, stream: int = 1) -> str:
    """Wait until `process` has written `needle` to its stderr (`stream` 0: its stdout), or ended, or
    `timeout` passed: what it wrote there."""
    deadline = time.monotonic() + timeout
    while needle not in (said := process.output()[stream]) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return said


# No test downloads a model or a dataset: set for the whole session (conftest.py) before any process or
# fork server starts, since huggingface_hub and datasets read them once, as they are imported.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# What the framework scripts (tests/doctor_scripts) import, for a server to import once: transformers
# is a lazy module, so its Trainer and GPT-2 are named themselves (with the datasets the Trainer imports,
# they cost each new process three seconds); Lightning, Accelerate and datasets load whole.
FRAMEWORK_MODULES = (
    "pytorch_lightning",
    "transformers.trainer",
    "transformers.models.gpt2.modeling_gpt2",
    "accelerate",
    "datasets",
)

# `torchrun --standalone --nproc-per-node N`, its ranks forked: `python FORKED_TORCHRUN N SCRIPT ARGS`, for the
# runs a test checks by hand (test_distributed.py holds that forked ranks end as torchrun's cold ones do)
FORKED_TORCHRUN = Path(__file__).with_name("forked_torchrun.py")


def run_python(
    script: Path, *args: object, env: dict[str, str] | None = None, preload: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in a new process, with this process's environment and `env`, forked from a
    server of this Python that imported torch and loaded the doctor's tracer once (which traces a run
    whose environment asks for it, as the doctor's --warm runs are traced): its exit code (negative:
    the signal that ended it), and what it printed to stdout and stderr together. `preload`: more
    modules the server imports first (`datasets` costs each new process two seconds)."""
    return _forked([sys.executable, str(script), *map(str, args)], env, preload)


def run_torchrun(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun ARGS` (`python -m torch.distributed.run`), its agent forked as run_python forks a script:
    the agent starts each rank as torchrun does, a new Python of its own."""
    return _forked([sys.executable, "-m", "torch.distributed.run", *map(str, args)], env, ())


def _forked(command: list[str], env: dict[str, str] | None, preload: tuple[str, ...]) -> subprocess.CompletedProcess:
    log = Path(tempfile.mkdtemp(prefix="exactresume-python-")) / "output"
    code = spawn_python(command, log, env, preload).wait()
    output = log.read_text(errors="replace")
    shutil.rmtree(log.parent)
    return subprocess.CompletedProcess(command, code, output, output)


def spawn_python(
    command: list[str], log: Path, env: dict[str, str] | None = None, preload: tuple[str, ...] = ()
) -> forkserver.Run:
    """`command` (`python SCRIPT ARGS`, or `python -m MODULE ARGS`) started as run_python starts it, its
    output appended to `log`, not waited for."""
    with stable_environ():
        kind = replace(TRACED_KIND, optional=TRACED_KIND.optional + preload)
        # The server the doctor's runs fork from (the tracer's shim first on its path, which starts nothing
        # without the doctor's variables): one server of each kind, not two.
        shim_first = os.pathsep.join(p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p)
        server_env = os.environ | {"PYTHONPATH": shim_first}
        return forkserver.spawn(command, os.environ | (env or {}), log, kind, server_env)


@contextlib.contextmanager
def stable_environ():
    """This process's environment less pytest's PYTEST_CURRENT_TEST, which changes at every test: the
    environment a user's shell gives a command, the same for every test (one warm server serves them)."""
    current = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        yield
    finally:
        if current is not None:
            os.environ["PYTEST_CURRENT_TEST"] = current


def reference_run(tmp_path_factory, command: Callable[[Path], list]) -> Path:
    """The uninterrupted run: `exactresume COMMAND(folder)` for a new folder, which it returns, made in
    this process on one thread, as the CLI's own runs are: what an interrupted run must end equal to."""
    folder = tmp_path_factory.mktemp("reference")
    with one_torch_thread():
        finished = call_cli(*command(folder))
    assert finished.returncode == 0, finished.stderr
    return folder


@contextlib.contextmanager
def one_torch_thread():
    """In-process runs on one thread, as the CLI's own runs are (the result depends on the count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Ports a test listens on: below Linux's range for outgoing connections (32768 and up), one of which another
# process's client may hold by the time the test listens; above SeaweedFS's (bench/seaweed.py: 10000-29999).
TEST_PORTS = range(30000, 32768)
_PORT_DRAWS = random.SystemRandom()  # not the global RNG, which tests seed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, drawn from TEST_PORTS."""
    while True:
        port = _PORT_DRAWS.choice(TEST_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def assert_one_line_error(finished: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, exactly one line on stderr, no traceback, and it mentions each needle."""
    assert finished.returncode == 2, finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def max_abs_difference(a: Path, b: Path) -> float:
    """Of two weights files. NaN when a NaN or Inf differs (Python's max would drop a NaN that does not come first)."""
    from exactresume.core.compare import weight_distance
    from exactresume.store.weights import read_weights

    return weight_distance(read_weights(a)[0], read_weights(b)[0])["max_abs_diff"]


def assert_weights_equal(a: Path, b: Path) -> None:
    """Two weights files hold the same names, every tensor `torch.equal`."""
    from exactresume.store.weights import read_weights

    first, second = read_weights(a)[0], read_weights(b)[0]
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def assert_same_run(folder: Path, reference: Path) -> None:
    """`folder`'s run ended bit-identical to `reference`'s: every weight `torch.equal`, and its loss log
    (and samples log, when the reference kept one) byte for byte."""
    assert_weights_equal(folder / "final.pth", reference / "final.pth")
    for log in ("log.csv", "samples.csv"):
        if log == "log.csv" or (reference / log).exists():
            assert (folder / log).read_bytes() == (reference / log).read_bytes(), log


def assert_lab_dict(path: Path, step: int) -> dict:
    """A plain torch.load of `path` is the lab text's dict: model (name -> tensor), optimizer (state and
    param_groups), step (an int) and gen_state (the batch generator's ByteTensor) at the top."""
    state = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "step", "gen_state"} <= state.keys(), sorted(state)
    assert all(isinstance(tensor, torch.Tensor) for tensor in state["model"].values())
    assert "model.embed_tokens.weight" in state["model"]
    assert state["optimizer"].keys() == {"state", "param_groups"}
    assert len(state["optimizer"]["state"]) == len(state["optimizer"]["param_groups"][0]["params"])
    assert type(state["step"]) is int and state["step"] == step
    assert state["gen_state"].dtype == torch.uint8 and state["gen_state"].dim() == 1
    return state


# -- processes, from /proc ---------------------------------------------------------------------------


def children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process started by `pid`, and by those (the launcher's agent and its ranks)."""
    tree, found, todo = children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ranks_of(launcher: forkserver.Run) -> list[int]:
    """The training processes under `launcher`: the children of its one child, the agent."""
    tree = children()
    return [rank for agent in tree.get(launcher.pid, []) for rank in tree.get(agent, [])]


def process_state(pid: int) -> str | None:
    """A process's state letter (R, S, T, Z, ...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
