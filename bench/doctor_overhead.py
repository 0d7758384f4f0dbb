"""What the doctor's tracer adds to a training step: the default preset's steps with and without it, interleaved.

    python -m bench.doctor_overhead [--data data/kjv] [--steps 20]

bench/doctor_costs.py keeps its figure, beside the framework scripts', in docs/doctor_costs.json.

Three identical runs in this one process; steps alternate between them, the tracer installed (every
hook and wrapper of `exactresume doctor`, its trace written to a temporary folder) around the traced
runs' steps only, so that a busy machine slows them alike: one hashing with xxh3, one with BLAKE2b
(the standard library's, what a Python without xxhash pays). Prints the median seconds per step of
each and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.doctor.tracer import fingerprint as fp
from exactresume.doctor.tracer.hooks import Tracer
from exactresume.doctor.tracer.install import install
from exactresume.training.loop import build_run, train_step


def measure(data: Path, steps: int) -> tuple[float, float, float]:
    """Median seconds per step without the tracer, with it (xxh3), and with it hashing with BLAKE2b."""
    config = TrainConfig(steps=steps + 1)
    tokens = load_tokens(data)
    runs = {name: build_run(config, tokens) for name in ("plain", "xxh3", "blake2b")}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as folder:
        tracers = {name: Tracer(f"{folder}/{name}", limit=10**9, crash_from=None) for name in ("xxh3", "blake2b")}
        for _ in range(steps):
            for name, run in runs.items():
                remove = install(tracers[name]) if name in tracers else None
                fp.use_stdlib_hash(name == "blake2b")
                started = time.perf_counter()
                train_step(run)
                seconds[name].append(time.perf_counter() - started)
                if remove:
                    remove()
        fp.use_stdlib_hash(False)
        for tracer in tracers.values():
            tracer.close({"event": "exit", "steps": tracer.step})
    plain, xxh3, blake2b = (statistics.median(seconds[name]) for name in runs)
    return plain, xxh3, blake2b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    plain, traced, stdlib = measure(args.data, args.steps)
    print(
        f"per step: {plain:.4f} s without the tracer, {traced:.4f} s with it ({traced / plain:.3f}x), "
        f"{stdlib:.4f} s hashing with BLAKE2b ({stdlib / plain:.3f}x); {args.steps} steps each, interleaved, "
        "default preset"
    )


if __name__ == "__main__":
    main()
