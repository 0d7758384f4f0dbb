"""What the doctor's tracer adds to a training step: the default preset's steps with and without it, interleaved.

    python -m bench.doctor_overhead [--data data/kjv] [--steps 20]

bench/doctor_costs.py keeps its figure, beside the framework scripts', in docs/doctor_costs.json.

Two identical runs in this one process; steps alternate between them, the tracer installed (every
hook and wrapper of `exactresume doctor`, its trace written to a temporary folder) around the
traced run's steps only, so that a busy machine slows both alike. Prints the median seconds per
step of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.doctor.tracer.hooks import Tracer
from exactresume.doctor.tracer.install import install
from exactresume.training.loop import build_run, train_step


def measure(data: Path, steps: int) -> tuple[float, float]:
    """Median seconds per step without and with the tracer."""
    config = TrainConfig(steps=steps + 1)
    tokens = load_tokens(data)
    plain, traced = build_run(config, tokens), build_run(config, tokens)
    plain_seconds, traced_seconds = [], []
    with tempfile.TemporaryDirectory() as folder:
        tracer = Tracer(folder, limit=10**9, crash_from=None)
        for _ in range(steps):
            started = time.perf_counter()
            train_step(plain)
            plain_seconds.append(time.perf_counter() - started)
            remove = install(tracer)
            started = time.perf_counter()
            train_step(traced)
            traced_seconds.append(time.perf_counter() - started)
            remove()
        tracer.close({"event": "exit", "steps": tracer.step})
    return statistics.median(plain_seconds), statistics.median(traced_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    plain, traced = measure(args.data, args.steps)
    print(
        f"per step: {plain:.4f} s without the tracer, {traced:.4f} s with it "
        f"({traced / plain:.3f}x; {args.steps} steps each, interleaved, default preset)"
    )


if __name__ == "__main__":
    main()
