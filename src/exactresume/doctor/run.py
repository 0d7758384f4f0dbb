"""One traced run of the user's command: environment, child process, and its traces read back.

The tracer (tracer/) is started in the child by the `sitecustomize` in tracer/shim, put first on
the child's PYTHONPATH, and so in every Python process the command starts (each torchrun rank, and
torchrun itself); each writes OUT/traces/NAME/trace-PID.jsonl, and the command's output goes to
OUT/logs/NAME.log. The processes that stepped an optimizer are kept, by rank. A process whose Python
the tracer cannot start in (no torch, say) ends before the script runs and leaves failed-PID.json:
the run is refused in one line, as is a command that started no Python the tracer could see.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exactresume.doctor.tracer import CRASH, CUT
from exactresume.doctor.warm import Launcher
from exactresume.errors import UserError

TRACER_DIR = Path(__file__).resolve().parent / "tracer"
SHIM_DIR = TRACER_DIR / "shim"


@dataclass
class Process:
    """What one traced process did: a record per optimizer step, its saves and loads."""

    pid: int
    rank: int | None = None
    steps: list[dict] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # iterators made, RNG states set, in order
    lost: list[dict] = field(default_factory=list)  # a hook of the tracer's that failed: what, fields, step
    end: int | None = None  # CUT or CRASH when the tracer ended it
    weights: np.ndarray | None = None


@dataclass
class TracedRun:
    """One run of the command: its exit code, its stepping processes (rank order), the paths it wrote."""

    name: str
    command: list[str]
    rc: int
    wall_s: float
    log: Path
    forked_from: int | None  # the pid of the fork server it was forked from (--warm), None when started cold
    processes: list[Process] = field(default_factory=list)  # those that stepped, saved or loaded, by rank
    wrote: dict[str, bool] = field(default_factory=dict)  # path -> new (it was not there before)
    kept: dict[str, str] = field(default_factory=dict)  # a path that was there before -> its copy
    traced: int = 0  # the processes the tracer started in
    hashes: set[str] = field(default_factory=set)  # the hash their fingerprints use (one Python: one hash)
    not_started: list[dict] = field(default_factory=list)  # where the tracer could not start: python, error

    @property
    def stepping(self) -> list[Process]:
        return [p for p in self.processes if p.steps]

    @property
    def first(self) -> Process:
        return (self.stepping or self.processes or [Process(0)])[0]

    @property
    def steps(self) -> list[dict]:
        return self.first.steps

    @property
    def saves(self) -> list[dict]:
        return [save for process in self.processes for save in process.saves]

    @property
    def loads(self) -> list[dict]:
        return [load for process in self.processes for load in process.loads]

    @property
    def weights(self) -> np.ndarray | None:
        return self.first.weights

    def ended(self, code: int) -> bool:
        """The tracer ended it with `code`: the command's own code, or a launcher's failure over its ranks."""
        return self.rc == code or (self.rc != 0 and any(p.end == code for p in self.processes))

    @property
    def cut(self) -> bool:
        return self.ended(CUT) and not self.ended(CRASH)

    @property
    def crashed(self) -> bool:
        return self.ended(CRASH)

    def failure(self) -> str:
        """One line: the exit code, the last line the command printed, and where all of it is."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        missing = re.fullmatch(r"ModuleNotFoundError: No module named '([\w.]+)'", lines[-1]) if lines else None
        if missing:
            module = missing.group(1)
            return (
                f"the command needs {module!r}, which its Python does not have (pip install it, or run the command "
                f"with the Python that has it); the {self.name} run's output: {self.log}"
            )
        last = f"its last line: {lines[-1]!r}" if lines else "it printed nothing"
        return f"the command failed (exit code {self.rc}) in the {self.name} run; {last}; its output: {self.log}"


def _child_env(trace: Path, out: Path, limit: int, crash_from: int | None, made: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p)
    env["EXACTRESUME_DOCTOR_TRACER_DIR"] = str(TRACER_DIR)
    env["EXACTRESUME_DOCTOR_TRACE"] = str(trace)
    env["EXACTRESUME_DOCTOR_LIMIT"] = str(limit)
    env["EXACTRESUME_DOCTOR_KEEP"] = str(out / "files" / "before" / trace.name)
    env["EXACTRESUME_DOCTOR_OUT"] = str(out)
    env["EXACTRESUME_DOCTOR_MADE"] = os.pathsep.join(made)
    env["EXACTRESUME_DOCTOR_PID"] = str(os.getpid())  # a run ends at its next step once the doctor is gone
    env.pop("EXACTRESUME_DOCTOR_CRASH_FROM", None)
    if crash_from is not None:
        env["EXACTRESUME_DOCTOR_CRASH_FROM"] = str(crash_from)
    return env


def run_traced(
    name: str,
    command: list[str],
    out: Path,
    limit: int,
    launcher: Launcher,
    crash_from: int | None = None,
    timeout: float | None = None,
    made: list[str] = (),
) -> TracedRun:
    """Run `command` once under the tracer, cut as its optimizer step `limit + 1` begins; a path that
    was there before and that the command changes is copied into OUT/files/before/NAME first (not
    one of `made`, the paths the doctor's earlier runs made)."""
    trace, log = out / "traces" / name, out / "logs" / f"{name}.log"
    for stale in trace.glob("*") if trace.is_dir() else ():
        stale.unlink()
    env = _child_env(trace, out, limit, crash_from, list(made))
    started = time.perf_counter()
    child = launcher.start(command, env, log)
    try:
        rc = child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise UserError(f"the {name} run took longer than --timeout {timeout:g}s; its output: {log}") from None
    run = TracedRun(name, command, rc, time.perf_counter() - started, log, child.server)
    _read_traces(run, trace)
    _check_started(run)
    return run


def read_run(name: str, out: Path) -> TracedRun | None:
    """A run of an earlier doctor into OUT, as its traces on disk tell it (the paths it wrote and kept),
    or None where it never started."""
    trace = out / "traces" / name
    if not trace.is_dir():
        return None
    run = TracedRun(name, [], -1, 0.0, out / "logs" / f"{name}.log", None)
    _read_traces(run, trace)
    return run


def _check_started(run: TracedRun) -> None:
    """One line when the tracer saw nothing: it could not start in the command's Python, or the command
    started no Python it could start in (a command that failed before is the examiner's to report)."""
    if run.not_started and not run.stepping:
        first = run.not_started[0]
        hint = "; the doctor traces PyTorch training: run the command with a Python that has torch"
        hint = hint if "'torch'" in first["error"] else ""
        raise UserError(f"the tracer could not start in {first['python']}: {first['error']}{hint}")
    if not run.traced and run.rc == 0:
        raise UserError(
            f"the tracer started in no process of the {run.name} run: {run.command[0]} is not a Python program "
            "and started none, or its Python skips PYTHONPATH or site (-E, -I, -S); the doctor traces the Python "
            f"processes a command starts; its output: {run.log}"
        )


def _read_traces(run: TracedRun, folder: Path) -> None:
    """Fill `run` from every process's trace: the paths all of them wrote, and the processes that stepped."""
    earliest: dict[str, int] = {}
    for path in sorted(folder.glob("trace-*.jsonl")) if folder.is_dir() else []:
        process = Process(int(path.stem.removeprefix("trace-")))
        run.traced += 1
        for event in _load_events(path):
            _file_event(run, event, earliest)
            _sort_event(process, event)
            if event["event"] == "start" and "hash" in event:
                run.hashes.add(event["hash"])
        if process.steps or process.saves or process.loads:
            read_weights(process, path)
            run.processes.append(process)
    for path in sorted(folder.glob("failed-*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            run.not_started.append(json.loads(path.read_text()))
    run.processes.sort(key=lambda p: (p.rank is None, p.rank or 0, -len(p.steps)))


def _file_event(run: TracedRun, event: dict, earliest: dict[str, int]) -> None:
    """A written path (new in any process counts as new), and the first copy kept of each path."""
    if event["event"] == "wrote":
        run.wrote[event["path"]] = run.wrote.get(event["path"], False) or event["new"]
    elif event["event"] == "kept" and event["t"] < earliest.get(event["path"], event["t"] + 1):
        earliest[event["path"]] = event["t"]  # another rank may copy what the first one already changed
        run.kept[event["path"]] = event["copy"]


def _sort_event(process: Process, event: dict) -> None:
    """Steps, saves and loads; a save's path follows the renames after it (atomic writes), and a save
    into a buffer takes the path of the file the buffer is written to next (Lightning's fsspec write)."""
    kind = event["event"]
    if kind == "start":
        process.rank = event.get("rank")
    elif kind == "step":
        process.steps.append(event)
    elif kind == "save":
        process.saves.append(event)
    elif kind == "load":
        process.loads.append(event)
    elif kind == "end":
        process.end = event["code"]
    elif kind in ("iter", "rng_set", "loader", "layout"):
        process.events.append(event)
    elif kind == "lost":
        process.lost.append(event)
    elif kind == "rename":
        renamed(process.saves, event["source"], event["target"])
    elif kind == "wrote" and process.saves and process.saves[-1]["path"] is None:
        process.saves[-1]["path"] = event["path"]


def renamed(saves: list[dict], source: str, target: str) -> None:
    """The newest save at `source` (or not yet named) takes `target`; a folder's rename (a staged
    checkpoint folder put in place) moves every save inside it."""
    inside = source + os.sep
    for save in saves:
        if save["path"] and save["path"].startswith(inside):
            save["path"] = target + save["path"][len(source) :]
    for save in reversed(saves):
        if save["path"] == source or save["path"] is None:
            save["path"] = target
            break


def _load_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the last line of a process ended mid-write
    return events


def read_weights(process: Process, trace: Path) -> None:
    """Each step's weight sample (`sample`: how many values it appended); NaN where the tracer lost it."""
    weights = trace.with_name(trace.name.replace("trace-", "weights-").replace(".jsonl", ".f32"))
    counts = [step.get("sample", 0) for step in process.steps]
    width = max(counts, default=0)
    if not width or not weights.exists():
        return
    values, at = np.fromfile(weights, dtype=np.float32), 0
    process.weights = np.full((len(counts), width), np.nan, dtype=np.float32)
    for row, count in enumerate(counts):
        if count == width and at + count <= values.size:
            process.weights[row] = values[at : at + count]
        at += count
