"""What `--nproc N` costs to start: `exactresume train --nproc N` (its ranks forked from the command,
which imported torch once) against torchrun started by hand on the same command (each rank a new
Python), both from a cold shell, alternated, in one run.

    python -m bench.launch --data data/kjv --out runs/launch --nproc 2 --repeats 3

Each run trains 2 short steps, so the figures are the start and the end of a run: wall seconds and
CPU seconds (the processes' user + system time, ranks included). Writes OUT/launch.json with the
medians and the ratios ours ÷ torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLAGS = ["--steps", "2", "--batch", "4", "--seq-len", "16", "--quiet"]


def commands(data: Path, out: Path, nproc: int) -> dict[str, list[str]]:
    """The two launches of the same run, each into a folder of its own under `out`."""
    train = ["train", "--data", str(data), *FLAGS]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    ours = [sys.executable, "-m", "exactresume.cli", *train, "--out", str(out / "ours"), "--nproc", str(nproc)]
    return {
        "exactresume": ours,
        "torchrun": [*torchrun, "-m", "exactresume.cli", "--", *train, "--out", str(out / "torchrun")],
    }


def timed(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of `command` and every process it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(data: Path, out: Path, nproc: int, repeats: int) -> dict:
    samples: dict[str, list[tuple[float, float]]] = {"exactresume": [], "torchrun": []}
    for repeat in range(repeats):
        runs = commands(data, out / str(repeat), nproc)
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))  # the machine's load falls on both
        for name in order:
            samples[name].append(timed(runs[name]))
    medians = {
        name: {"wall_s": statistics.median(w for w, _ in got), "cpu_s": statistics.median(c for _, c in got)}
        for name, got in samples.items()
    }
    ours, theirs = medians["exactresume"], medians["torchrun"]
    return {
        "nproc": nproc,
        "repeats": repeats,
        "medians": medians,
        "wall_ratio": round(ours["wall_s"] / theirs["wall_s"], 3),
        "cpu_ratio": round(ours["cpu_s"] / theirs["cpu_s"], 3),
        "cores": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args.data, args.out, args.nproc, args.repeats)
    (args.out / "launch.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
