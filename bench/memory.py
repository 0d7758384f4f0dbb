"""Peak memory of training, saving and resuming one preset, each run in a fresh process.

    python -m bench.memory --preset default --data data/kjv --folder /tmp/x   # prints one JSON object

Training and saving: a fresh process builds the run, trains `--steps` steps and saves the resume file.
Training reaches its peak once the optimizer's moments exist beside a step's activations and
gradients, from the second step on (the first step makes the moments only at its end), and the
allocator's high-water mark settles within a few steps: 6 by default.
Resuming: another fresh process builds the run as `train --resume` does, loads and restores that
file, then trains as many steps; its peak is what a resumed run must fit in, and the goal is that it
fits wherever training fits (resume peak <= training peak). A fresh process keeps other benchmarks'
allocations out of the figures. Peaks are the kernel's own high-water mark (VmHWM), reset when the run
is built, so short spikes between samples are not missed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.store.access import load_resume, save_resume
from exactresume.store.resume import capture
from exactresume.training.loop import build_run, train

from .measure import peak_rss_bytes, reset_peak_rss, rss_bytes

ROOT = Path(__file__).resolve().parent.parent


def state_bytes(state: object) -> int:
    """Bytes of the distinct tensor storages in a (nested) state."""
    storages: dict[int, int] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(state)
    return sum(storages.values())


def phase(action) -> tuple[int, int, object]:
    """(RSS before, peak RSS during, result) of `action()`."""
    before = rss_bytes()
    reset_peak_rss()
    result = action()
    return before, peak_rss_bytes(), result


def train_and_save(config: TrainConfig, data: Path, resume: Path, steps: int) -> dict:
    run = build_run(config, load_tokens(data))
    built, train_peak, _ = phase(lambda: train(run, steps))
    save_before, save_peak, _ = phase(lambda: save_resume(resume, run.parts()))
    size = state_bytes(capture(run.parts()))
    return {
        "state_bytes": size,
        "file_bytes": resume.stat().st_size,
        "rss_built": built,
        "train_peak": train_peak,
        "save_rss_before": save_before,
        "save_peak": save_peak,
        "save_extra_copies": (save_peak - save_before) / size,
    }


def resume_and_train(config: TrainConfig, data: Path, resume: Path, steps: int) -> dict:
    run = build_run(config, load_tokens(data))
    built, load_peak, _ = phase(lambda: load_resume(resume, run.parts()))
    after_restore = rss_bytes()
    train(run, run.step.value + steps)
    return {
        "resume_rss_built": built,
        "resume_load_peak": load_peak,
        "resume_rss_after_restore": after_restore,
        "resume_peak": peak_rss_bytes(),  # the window opened before loading: loading and training
    }


def _command(config: TrainConfig, data: Path, folder: Path, steps: int) -> list[str]:
    flags = ["--preset", config.preset, "--data", data, "--folder", folder, "--batch", config.batch]
    return [sys.executable, "-m", "bench.memory", *map(str, flags + ["--seq-len", config.seq_len, "--steps", steps])]


def _fresh(command: list[str]) -> dict:
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if finished.returncode != 0:
        raise RuntimeError(f"bench.memory failed:\n{finished.stderr}")
    return json.loads(finished.stdout)


STEPS = 6


def memory_figures(config: TrainConfig, data: Path, folder: Path, steps: int = STEPS) -> dict:
    """The memory figures of one preset: training and saving in one fresh process, resuming in another."""
    command = _command(config, data, folder, steps)
    figures = _fresh(command) | _fresh([*command, "--resume"])
    (folder / "memory-resume.pth").unlink()
    resumed = figures["resume_peak"] / figures["train_peak"]
    return figures | {"resume_vs_train_peak": resumed, "resume_goal": "<= 1.0", "resume_met": resumed <= 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps inside the measured window")
    parser.add_argument("--resume", action="store_true", help="resume FOLDER/memory-resume.pth instead")
    args = parser.parse_args(argv)
    config = TrainConfig(steps=10**6, batch=args.batch, seq_len=args.seq_len, preset=args.preset)
    measure = resume_and_train if args.resume else train_and_save
    json.dump(measure(config, args.data, args.folder / "memory-resume.pth", args.steps), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
