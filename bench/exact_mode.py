"""The N-independent mode's cost: step time with `--micro-batch` ÷ plain DDP, on 2 processes, in one run.

    python -m bench.exact_mode --data data/kjv --out runs/bench     # lab size: batch 8 x 128, default preset

Both runs live in the same two processes (one torchrun), and blocks of steps of each alternate,
rotating which goes first, so the machine's other load falls on both alike. Two settings of the
mode: one micro-batch per rank (--micro-batch 4, the same shapes DDP computes: the cost is the
gradient's gather and tree), and one sequence per micro-batch (--micro-batch 1: smaller matmuls).
Writes OUT/exact_mode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

GOAL = 1.15  # the bound on the step-time ratio against plain DDP


def worker(data: Path, out: Path, steps: int, reps: int) -> None:
    """Inside torchrun: build the three runs, time interleaved blocks of steps, rank 0 writes the json."""
    from bench.measure import interleave, ratio, timed
    from exactresume.config import TrainConfig
    from exactresume.core.data import load_tokens
    from exactresume.parallel.replicas import process_group, replicate
    from exactresume.training.loop import build_run, train_step
    from exactresume.world import World

    world, tokens = World.from_env(), load_tokens(data)
    with process_group(world):
        runs = {}
        for name, micro_batch in (("ddp", 0), ("exact_per_rank", 4), ("exact_per_sequence", 1)):
            runs[name] = build_run(TrainConfig(steps=10_000, micro_batch=micro_batch), tokens)
            replicate(runs[name], world)

        def block(run) -> float:
            return timed(lambda: [train_step(run) for _ in range(steps)]) / steps

        times = interleave({name: (lambda run=run: block(run)) for name, run in runs.items()}, reps)
        if world.is_main:
            figures = {
                "processes": world.size,
                "steps_per_block": steps,
                "goal": f"<= {GOAL}",
                "per_rank_micro_batch": ratio(times["exact_per_rank"], times["ddp"]),
                "one_sequence_micro_batch": ratio(times["exact_per_sequence"], times["ddp"]),
            }
            figures["met"] = figures["per_rank_micro_batch"]["ratio"] <= GOAL
            out.mkdir(parents=True, exist_ok=True)
            (out / "exact_mode.json").write_text(json.dumps(figures, indent=2) + "\n")
            print(json.dumps(figures, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=5, help="rounds of blocks (after one warm-up round)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.data, args.out, args.steps, args.reps)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "bench.exact_mode", "--worker", "--data", str(args.data), "--out", str(args.out),
               "--steps", str(args.steps), "--reps", str(args.reps)]  # fmt: skip
    return subprocess.run(command, env=os.environ | {"OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())
