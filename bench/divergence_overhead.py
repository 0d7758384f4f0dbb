"""What `train --divergence` costs per step: a resumed run's steps with and without the twin, interleaved.

    .venv/bin/python bench/divergence_overhead.py [--data data/kjv] [--steps 10]

Both runs resume from the same resume file (made here, after one step) without the optimizer state,
as the lab's noopt run does, in this one process; steps alternate between them so that a busy
machine slows both alike. Prints the median seconds per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.store.access import save_resume
from exactresume.training.divergence import DivergenceLog
from exactresume.training.job import TrainJob
from exactresume.training.job_run import prepare_run
from exactresume.training.loop import build_run, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps + 2)
    with tempfile.TemporaryDirectory() as folder:
        first = build_run(config, load_tokens(args.data))
        train_step(first)
        save_resume(Path(folder) / "resume.pth", first.parts())
        job = TrainJob(
            config, args.data, Path(folder), resume=Path(folder) / "resume.pth", skip_parts=frozenset({"optimizer"})
        )
        plain, tracked = prepare_run(job), prepare_run(job)
        log = DivergenceLog(job, Path(folder) / "divergence.csv")
        log.attach(tracked)
        plain_seconds, tracked_seconds = [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            train_step(plain)
            plain_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            log.record(train_step(tracked))
            tracked_seconds.append(time.perf_counter() - started)
    plain_median, tracked_median = statistics.median(plain_seconds), statistics.median(tracked_seconds)
    print(
        f"per step: {plain_median:.4f} s without the twin, {tracked_median:.4f} s with it "
        f"({tracked_median / plain_median:.2f}x; {args.steps} steps each, interleaved)"
    )


if __name__ == "__main__":
    main()
