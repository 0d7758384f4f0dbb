"""Recovery after kill -9: process start to the end of the first resumed step, against a fresh start.

    python -m bench.recovery --preset minimind-26m --data data/kjv --folder /tmp/r --reps 3

`exactresume train --save-every 1` is killed with SIGKILL once its checkpoint of step KILL_AFTER
is written (so during a later step). Then, round by round, two new processes alternate: `fresh`
(imports, data verification, building the run, its first step) and `resumed` (the same, plus
finding the newest checkpoint, reading and verifying it, restoring it). Each reports when each
phase ended, counted from the moment the parent spawned it, so interpreter start is included in
`imports`. The figure is the median round-by-round ratio resumed / fresh of those totals.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_AFTER = 3  # the killed run's newest checkpoint
STEPS = 50


def child(kind: str, spawned: float, preset: str, data: str, out: str, batch: int, seq_len: int) -> dict:
    marks = {}
    mark = lambda name: marks.__setitem__(name, time.time() - spawned)  # noqa: E731
    from exactresume.config import TrainConfig
    from exactresume.core.data import load_tokens
    from exactresume.store.numbered import CheckpointStore
    from exactresume.store.resume import restore
    from exactresume.store.sealed import load_sealed
    from exactresume.training.loop import build_run, train_step

    mark("imports")
    tokens = load_tokens(Path(data))
    mark("data verification")
    run = build_run(TrainConfig(steps=STEPS, batch=batch, seq_len=seq_len, preset=preset), tokens)
    mark("building the run")
    if kind == "resumed":
        newest = CheckpointStore(Path(out) / "checkpoints").checkpoints()[-1]
        mark("finding the checkpoint")
        state = load_sealed(newest.path)
        mark("reading and verifying it")
        restore(state, run.parts())
        del state  # the run holds what it needs; a job drops the loaded file's state here too
        mark("restoring it")
    train_step(run)
    mark("the first step")
    return marks


def spawn(kind: str, args: argparse.Namespace) -> dict:
    spawned = time.time()
    command = [sys.executable, "-m", "bench.recovery", "--child", kind, str(spawned)]
    command += ["--preset", args.preset, "--data", str(args.data), "--folder", str(args.folder)]
    command += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if finished.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{finished.stderr}")
    return json.loads(finished.stdout)


def killed_run(args: argparse.Namespace) -> None:
    """A training run with a checkpoint every step, killed with SIGKILL after step KILL_AFTER's."""
    command = [sys.executable, "-m", "exactresume.cli", "train", "--out", str(args.folder), "--data", str(args.data)]
    command += ["--preset", args.preset, "--steps", str(STEPS), "--batch", str(args.batch)]
    command += ["--seq-len", str(args.seq_len), "--save-every", "1", "--quiet"]
    process = subprocess.Popen(command, cwd=ROOT)
    checkpoint = args.folder / "checkpoints" / f"step-{KILL_AFTER:08d}.pth"
    while not checkpoint.exists():
        if process.poll() is not None:
            raise RuntimeError(f"the run ended (exit {process.returncode}) before step {KILL_AFTER}")
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def phases(marks: dict) -> dict:
    """Seconds each phase took, from the cumulative marks."""
    names, ends = list(marks), list(marks.values())
    return {name: end - start for name, start, end in zip(names, [0.0, *ends], ends)}


def bench_recovery(args: argparse.Namespace) -> dict:
    killed_run(args)
    rounds = []
    for index in range(args.reps + 1):  # round 0 warms the page cache and is dropped
        order = ("fresh", "resumed") if index % 2 else ("resumed", "fresh")
        marks = {kind: spawn(kind, args) for kind in order}
        if index:
            rounds.append(marks)
    totals = {kind: [r[kind]["the first step"] for r in rounds] for kind in ("fresh", "resumed")}
    ratios = [r["resumed"]["the first step"] / r["fresh"]["the first step"] for r in rounds]
    median_round = rounds[ratios.index(statistics.median_low(ratios))]
    return {
        "preset": args.preset,
        "recovery_ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "fresh_s": statistics.median(totals["fresh"]),
        "resumed_s": statistics.median(totals["resumed"]),
        "breakdown_s": {kind: phases(median_round[kind]) for kind in ("fresh", "resumed")},
        "goal": "<= 1.15",
    }


def recovery_figures(preset: str, data: Path, folder: Path, reps: int, batch: int = 8, seq_len: int = 128) -> dict:
    """bench_recovery with these settings (for bench/run.py)."""
    settings = argparse.Namespace(preset=preset, data=data, folder=folder, reps=reps, batch=batch, seq_len=seq_len)
    return bench_recovery(settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="minimind-26m")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--folder", type=Path, default=Path("runs/bench-recovery"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, spawned = args.child
        marks = child(kind, float(spawned), args.preset, str(args.data), str(args.folder), args.batch, args.seq_len)
        print(json.dumps(marks))
        return 0
    print(json.dumps(bench_recovery(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
