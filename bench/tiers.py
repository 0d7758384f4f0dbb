"""Two-tier figures (store/tiers.py): a checkpoint every step to a local tier, every N-th copied durable.

Each figure is steps/s of a long run's stretch (asynchronous.py's `steady` throughput: a background
save every step, `copy="during-next-step"` as `train --async-save` takes it, a save asked for while
the one before is written skipped) over steps/s without saving, in the same rounds:

    local-disk   the local tier on this machine's disk (beside the output), durable every `--durable-every`
    local-shm    the local tier on /dev/shm, durable on the disk, every `--durable-every`
    local-shm-process  the same, pickled by the helper process (`serializer="process"`, serializer.py)
    one-tier     the same saves into one folder on the disk, no tiers: today's `--save-every 1 --async-save`

and the durable copy's cost to the loop: steps/s with the copy every `--durable-every` steps over
steps/s with the same local tier and a copy never due.

    python -m bench.tiers --reps 3 --steps 30     # default preset; prints and writes runs/bench-tiers/tiers.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from exactresume.config import TrainConfig
from exactresume.core.data import ensure_data, load_tokens
from exactresume.training.loop import build_run

from .asynchronous import bench_async_throughput

SHARED_MEMORY = Path("/dev/shm")
NEVER = 10**9  # a durable_every no step of a bench reaches


def _throughput(run, scratch: Path, reps: int, steps: int, **options) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    return bench_async_throughput(run, scratch, reps, steps=steps, every=1, steady=True, **options)["async_throughput"]


def bench_tiers(run, out: Path, reps: int, steps: int, durable_every: int) -> dict:
    scratch = out / "scratch"
    figures = {"one-tier": _throughput(run, scratch, reps, steps)}
    kinds = [("local-disk", out, durable_every, "thread"), ("local-shm", SHARED_MEMORY, durable_every, "thread")]
    kinds += [("local-shm-process", SHARED_MEMORY, durable_every, "process")]
    for name, local_root, every, serializer in [*kinds, ("durable-copy-cost", SHARED_MEMORY, NEVER, "thread")]:
        with tempfile.TemporaryDirectory(prefix="exactresume-bench-tiers-", dir=local_root) as local:
            tiers = {"checkpoints": out / "durable", "local": Path(local) / "local", "durable_every": every}
            figures[name] = _throughput(run, scratch, reps, steps, serializer=serializer, **tiers)
        shutil.rmtree(out / "durable", ignore_errors=True)
    local, none_due = figures["local-shm"]["ratio"], figures["durable-copy-cost"]["ratio"]
    figures["durable-copy-cost"]["copy_over_no_copy"] = local / none_due
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Two tiers' figures (ratios against same-run baselines).")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"), help="prepared data (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-tiers"), help="folder for tiers.json")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--reps", type=int, default=3, help="measured rounds per figure (after one warm-up)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per throughput round")
    parser.add_argument("--durable-every", type=int, default=5)
    args = parser.parse_args(argv)
    ensure_data(args.data)
    run = build_run(TrainConfig(steps=10**6, batch=8, seq_len=128, preset=args.preset), load_tokens(args.data))
    args.out.mkdir(parents=True, exist_ok=True)
    figures = bench_tiers(run, args.out, args.reps, args.steps, args.durable_every)
    figures["settings"] = vars(args) | {"data": str(args.data), "out": str(args.out)}
    (args.out / "tiers.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    json.dump(figures, sys.stdout, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
