"""The lab's wall time vs the compute of its training steps.

`exactresume lab` (in a new process, as a user runs it) against (training steps in the lab) x (the
median step time of the same configuration measured in this process), interleaved round by round.
What is left over is process start, imports, data checks, saving, the comparison and the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.data import TokenData
from exactresume.lab.lab import DIVERGENCE_RUNS
from exactresume.training.loop import build_run, train

from .measure import Summary, interleave, ratio, timed

DEFAULT_STOP_AT = 30


def lab_training_steps(steps: int, stop_at: int) -> int:
    """straight + stop + resumed + noopt + noskip, and the fully restored twins that noopt and noskip
    step alongside for the divergence figure (`--divergence`): each a real training step."""
    return steps + stop_at + (3 + len(DIVERGENCE_RUNS)) * (steps - stop_at)


def lab_command(config: TrainConfig, stop_at: int, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "exactresume.cli",
        "lab",
        "--data",
        str(data),
        "--out",
        str(out),
        "--seed",
        str(config.seed),
        "--steps",
        str(config.steps),
        "--stop-at",
        str(stop_at),
        "--batch",
        str(config.batch),
        "--seq-len",
        str(config.seq_len),
        "--preset",
        config.preset,
        "--threads",
        str(config.threads),
    ]


def run_lab(command: list[str]) -> float:
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"the lab failed:\n{finished.stderr}")
    return 0.0


def bench_lab(
    config: TrainConfig, stop_at: int, data: TokenData, out: Path, reps: int, deadline: float | None = None
) -> dict:
    """Lab runs and blocks of in-process steps, alternating; at most `reps` rounds, none past `deadline`."""
    steps_in_lab = lab_training_steps(config.steps, stop_at)
    run = build_run(config.with_changes(steps=10**6), data)
    train(run, 2)  # the first steps allocate the optimizer's state: not a typical step
    block = min(steps_in_lab, 12)
    command = lab_command(config, stop_at, data.folder, out)
    trials = {
        "lab": lambda: timed(lambda: run_lab(command)),
        "compute": lambda: steps_in_lab * timed(lambda: train(run, run.step.value + block)) / block,
    }
    # Every lab is a new process with nothing to warm, and a warm-up round would cost a whole lab.
    times = interleave(trials, reps, warmup=0, deadline=deadline)
    figure = ratio(times["lab"], times["compute"])
    timings = json.loads((out / "details" / "timings.json").read_text())
    return {
        "lab_wall_ratio": figure["ratio"],
        "lab_wall": figure
        | {
            "training_steps": steps_in_lab,
            "step_s": Summary.of([c / steps_in_lab for c in times["compute"]]).to_dict(),
            "last_lab_timings_s": timings,
            "goal": "<= 1.3",
            "met": figure["ratio"] <= 1.3,
            "what": "exactresume lab wall time / (its training steps x step time measured between labs)",
        },
    }
