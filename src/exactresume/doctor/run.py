"""One traced run of the user's command: environment, child process, and its trace read back.

The tracer (tracer/) is started in the child by the `sitecustomize` in tracer/shim, put first on
the child's PYTHONPATH; its trace lands in OUT/traces/NAME and the child's output in OUT/logs/NAME.log.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from exactresume.doctor.tracer.hooks import CRASH, CUT
from exactresume.errors import UserError

TRACER_DIR = Path(__file__).resolve().parent / "tracer"
SHIM_DIR = TRACER_DIR / "shim"


@dataclass
class Run:
    """What one traced run did: its exit code, a record per optimizer step, its saves and loads."""

    name: str
    command: list[str]
    rc: int
    wall_s: float
    log: Path
    steps: list[dict] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # a file that was there before -> its copy
    weights: np.ndarray | None = None

    @property
    def cut(self) -> bool:
        return self.rc == CUT

    @property
    def crashed(self) -> bool:
        return self.rc == CRASH

    def written(self) -> list[str]:
        """The files (or DCP folders) this run saved that are still on disk, each once, in the order first saved."""
        seen = dict.fromkeys(s["path"] for s in self.saves if s["path"])
        return [p for p in seen if os.path.exists(p)]  # files, and the folders of DCP saves

    def failure(self) -> str:
        """One line: the exit code, the last line the command printed, and where all of it is."""
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        last = f"its last line: {lines[-1]!r}" if lines else "it printed nothing"
        return f"the command failed (exit code {self.rc}) in the {self.name} run; {last}; its output: {self.log}"


def child_env(trace: Path, limit: int, crash_from: int | None, keep: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p)
    env["EXACTRESUME_DOCTOR_TRACER_DIR"] = str(TRACER_DIR)
    env["EXACTRESUME_DOCTOR_TRACE"] = str(trace)
    env["EXACTRESUME_DOCTOR_LIMIT"] = str(limit)
    for name, value in (("EXACTRESUME_DOCTOR_CRASH_FROM", crash_from), ("EXACTRESUME_DOCTOR_KEEP", keep)):
        env.pop(name, None)
        if value is not None:
            env[name] = str(value)
    return env


def run_traced(
    name: str,
    command: list[str],
    out: Path,
    limit: int,
    crash_from: int | None = None,
    timeout: float | None = None,
    keep: Path | None = None,
) -> Run:
    """Run `command` once under the tracer, cut as its optimizer step `limit + 1` begins; with `keep`,
    a file that was there before and that the command replaces is copied there first."""
    trace, log = out / "traces" / name, out / "logs" / f"{name}.log"
    for stale in trace.glob("*") if trace.is_dir() else ():
        stale.unlink()
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "wb") as sink:
        try:
            child = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(trace, limit, crash_from, keep)
            )
        except OSError as error:
            raise UserError(f"cannot start the command {command[0]!r}: {error.strerror}") from error
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            rc = child.wait()
            raise UserError(f"the {name} run took longer than --timeout {timeout:g}s; its output: {log}") from None
    run = Run(name, command, rc, time.perf_counter() - started, log)
    read_trace(run, trace, child.pid)
    return run


def read_trace(run: Run, folder: Path, pid: int) -> None:
    """Fill `run` from the trace of the process that stepped (the child itself, or one it started)."""
    traces = sorted(folder.glob("trace-*.jsonl")) if folder.is_dir() else []
    if not traces:
        return
    events = {path: load_events(path) for path in traces}
    chosen = folder / f"trace-{pid}.jsonl"
    if chosen not in events or not any(e["event"] == "step" for e in events[chosen]):
        chosen = max(events, key=lambda p: sum(e["event"] == "step" for e in events[p]))
    follow_renames(run, events[chosen])
    weights = chosen.with_name(chosen.name.replace("trace-", "weights-").replace(".jsonl", ".f32"))
    if run.steps and weights.exists():
        values = np.fromfile(weights, dtype=np.float32)
        width = values.size // len(run.steps) if len(run.steps) else 0
        run.weights = values[: width * len(run.steps)].reshape(len(run.steps), width) if width else None


def load_events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the last line of a process ended mid-write
    return events


def follow_renames(run: Run, events: list[dict]) -> None:
    """Sort events into steps, saves and loads; a save's path follows the renames after it (atomic writes)."""
    for event in events:
        kind = event["event"]
        if kind == "step":
            run.steps.append(event)
        elif kind == "save":
            run.saves.append(event)
        elif kind == "load":
            run.loads.append(event)
        elif kind == "kept":
            run.kept[event["path"]] = event["copy"]
        elif kind == "rename":
            for save in reversed(run.saves):
                if save["path"] == event["source"] or save["path"] is None:
                    save["path"] = event["target"]
                    break
