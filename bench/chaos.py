"""Chaos test, long form: kill -9 a checkpointing run again and again; it must still end bit-exact.

    .venv/bin/python bench/chaos.py --data data/kjv --kills 100

Each trial trains `exactresume train --save-every 2 --keep 2 --resume auto` into a fresh folder and
restarts it after every kill until it exits 0. Half the kills are SIGKILLs sent at a random moment
after the process starts training; the other half are planned with EXACTRESUME_FAULT at a random
stage of a random save (inside the write, before the fsync, before the rename, between the rename
and the folder fsync, before the read-back, before the pruning), where a timer would land only by
luck. After every kill each complete checkpoint in the folder must verify. At the end of a trial
the final weights must be `torch.equal` to an uninterrupted run's, tensor by tensor, and log.csv
and samples.csv equal byte for byte. Prints the figures and writes them to OUT/chaos.json; exits 1
if any result differed or any complete checkpoint was damaged. Every process runs on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from exactresume.core.data import ensure_data
from exactresume.errors import CheckpointError
from exactresume.store.faults import FAULT_ENV
from exactresume.store.numbered import CheckpointStore
from exactresume.store.sealed import verify
from exactresume.store.weights import read_weights

SAVE_STAGES = ("write", "fsync", "rename", "folder-fsync", "verify", "retention")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_command(folder: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "exactresume.cli",
        "train",
        "--out",
        str(folder),
        "--data",
        str(args.data),
        "--steps",
        str(args.steps),
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--save-every",
        str(args.save_every),
        "--keep",
        "2",
        "--samples",
        str(folder / "samples.csv"),
        "--resume",
        "auto",
    ]


def reference_run(folder: Path, args: argparse.Namespace) -> float:
    """The uninterrupted run; returns its training time in seconds (after the resume line)."""
    child = subprocess.Popen(train_command(folder, args), env=ENV, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # "no checkpoint in ...; starting at step 0": training starts now
    started = time.perf_counter()
    child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"the reference run failed with exit code {child.returncode}")
    return time.perf_counter() - started


def damaged_checkpoints(folder: Path) -> int:
    """Complete (renamed) checkpoints that fail their checksum: must always be 0."""
    bad = 0
    for checkpoint in CheckpointStore(folder / "checkpoints").checkpoints():
        try:
            verify(checkpoint.path)
        except CheckpointError:
            bad += 1
    return bad


def kill_at_random_moment(folder: Path, args: argparse.Namespace, window: float, rng: random.Random) -> int:
    """Start a run, SIGKILL it a random time after it starts training; its exit code."""
    child = subprocess.Popen(
        train_command(folder, args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    child.stdout.readline()  # the resume line: what follows is training and saving
    time.sleep(rng.uniform(0.0, window))
    child.send_signal(signal.SIGKILL)
    child.communicate()
    return child.returncode


def run_with_fault(folder: Path, args: argparse.Namespace, fault: str | None) -> int:
    env = ENV | ({FAULT_ENV: fault} if fault else {})
    return subprocess.run(
        train_command(folder, args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ).returncode


def same_result(folder: Path, reference: Path) -> bool:
    ours, theirs = read_weights(folder / "final.pth")[0], read_weights(reference / "final.pth")[0]
    weights = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    logs = all((folder / name).read_bytes() == (reference / name).read_bytes() for name in ("log.csv", "samples.csv"))
    return weights and logs


def trial(
    folder: Path, kills: int, args: argparse.Namespace, window: float, rng: random.Random, tally: Counter
) -> None:
    """Kill the run `kills` times (fewer if it finishes first), then let it finish."""
    for _ in range(kills):
        if rng.random() < 0.5:
            code = kill_at_random_moment(folder, args, window, rng)
            kind = "random"
            if code == -signal.SIGKILL and CheckpointStore(folder / "checkpoints").leftovers():
                tally["random_mid_save"] += 1  # it died with a half-written .tmp: inside a save
        else:
            kind = rng.choice(SAVE_STAGES)
            code = run_with_fault(folder, args, f"{kind}@{rng.randint(1, 3)}")
        tally["processes"] += 1
        if code == 0:
            tally["finished_before_kill"] += 1
            return
        if code != -signal.SIGKILL:
            raise SystemExit(f"a run in {folder} exited with {code}, neither killed nor done")
        tally["kills"] += 1
        tally[f"kill_{kind}"] += 1
        tally["damaged_after_kill"] += damaged_checkpoints(folder)
    tally["processes"] += 1
    if run_with_fault(folder, args, None) != 0:
        raise SystemExit(f"the final run in {folder} failed")


def figures(tally: Counter, trials: int, differed: int, seconds: float) -> dict:
    stage_kills = sum(tally[f"kill_{stage}"] for stage in SAVE_STAGES)
    return {
        "trials": trials,
        "kills": tally["kills"],
        "kills_mid_save": stage_kills + tally["random_mid_save"],
        "kills_at_save_stage": {stage: tally[f"kill_{stage}"] for stage in SAVE_STAGES},
        "kills_at_random_moment": tally["kill_random"],
        "random_kills_that_left_a_tmp": tally["random_mid_save"],
        "processes": tally["processes"],
        "runs_that_finished_before_their_kill": tally["finished_before_kill"],
        "damaged_complete_checkpoints_after_kills": tally["damaged_after_kill"],
        "results_differed": differed,
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--kills", type=int, default=100, help="at least this many SIGKILLs in all")
    parser.add_argument("--kills-per-trial", type=int, default=10)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    args = parser.parse_args()
    ensure_data(args.data)
    shutil.rmtree(args.out, ignore_errors=True)
    started, rng, tally = time.perf_counter(), random.Random(args.seed), Counter()
    window = reference_run(args.out / "reference", args)
    trials = differed = 0
    while tally["kills"] < args.kills:
        trials += 1
        folder = args.out / f"trial-{trials:03d}"
        trial(folder, min(args.kills_per_trial, args.kills - tally["kills"]), args, window, rng, tally)
        differed += not same_result(folder, args.out / "reference")
        shutil.rmtree(folder)
        print(f"trial {trials}: {tally['kills']} kills so far, {differed} differed", flush=True)
    result = figures(tally, trials, differed, time.perf_counter() - started)
    (args.out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['trials']} trials, {result['kills']} kills, {result['kills_mid_save']} landed mid-save, "
        f"{result['results_differed']} final results differed"
    )
    print(json.dumps(result, indent=2))
    return 1 if differed or tally["damaged_after_kill"] else 0


if __name__ == "__main__":
    sys.exit(main())
