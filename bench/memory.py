"""Peak memory of training, saving and loading one preset, measured in a fresh process.

    python -m bench.memory --preset default --data data/kjv --folder /tmp/x   # prints one JSON object

A fresh process keeps other benchmarks' allocations out of the figures. Peaks are the kernel's own
high-water mark (VmHWM), reset before each phase, so short spikes between samples are not missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.store.resume import capture, load_resume, restore, save_resume
from exactresume.training.loop import build_run, train

from .measure import peak_rss_bytes, reset_peak_rss, rss_bytes


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


def measure(config: TrainConfig, data: Path, folder: Path, steps: int) -> dict:
    run = build_run(config, load_tokens(data))
    # The first step's peak is the highest: activations, gradients and the optimizer's new moments.
    built, train_peak, _ = phase(lambda: train(run, steps))
    size = state_bytes(capture(run.parts()))
    resume = folder / "memory-resume.pth"
    save_before, save_peak, _ = phase(lambda: save_resume(resume, run.parts()))
    load_before, load_peak, state = phase(lambda: load_resume(resume))
    held = rss_bytes()
    restore(state, run.parts())
    del state
    after_restore = rss_bytes()
    file_bytes = resume.stat().st_size
    resume.unlink()
    return {
        "state_bytes": size,
        "file_bytes": file_bytes,
        "rss_built": built,
        "train_peak": train_peak,
        "save_rss_before": save_before,
        "save_peak": save_peak,
        "save_extra_copies": (save_peak - save_before) / size,
        "load_rss_before": load_before,
        "load_peak": load_peak,
        "load_rss_holding_state": held,
        "load_extra_copies": (load_peak - load_before) / size,
        "rss_after_restore": after_restore,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1, help="training steps inside the measured window")
    args = parser.parse_args(argv)
    config = TrainConfig(steps=10**6, batch=args.batch, seq_len=args.seq_len, preset=args.preset)
    json.dump(measure(config, args.data, args.folder, args.steps), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
