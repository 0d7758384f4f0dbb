"""FSDP2 (`--shard fsdp`): memory per rank on 1, 2 and 4 processes, and resumes on another N.

    python -m bench.fsdp --data data/kjv --out runs/fsdp      # prints one JSON object, writes OUT/fsdp.json

Memory: a few steps of the 26M preset under torchrun on N processes (and DDP on 2, which keeps a
whole copy), each rank reporting the bytes its own weights, gradients and AdamW state take (the
local shards of the DTensors), its resident memory once the model is built and sharded, and the
peak of the training steps after that (VmHWM reset there: the whole model every rank builds
before sharding it, a transient, is left out; the resident memory includes the ~0.5 GB every
torch process has). Each is measured twice: with glibc's default allocator settings, and with
MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB, which keeps glibc from raising its threshold after each
large free: then the buffers FSDP2 frees after each block go back to the system instead of
staying in the heap. Resumes: the lab's shape (60 steps, batch 8 x 128, default preset) on
FSDP2, straight on 1 and 2 processes, stopped at 30 on 1 and 2, and resumed 2 -> 2 (bit-identical
expected), 2 -> 1, 2 -> 4 and 1 -> 2, each with its sample log compared to the straight run's.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from exactresume.config import TrainConfig
from exactresume.core.compare import weight_distance
from exactresume.core.steplog import read_samples
from exactresume.store.weights import read_weights

from .measure import load_average, peak_rss_bytes, reset_peak_rss, rss_bytes

MEMORY_PRESET, MEMORY_STEPS = "minimind-26m", 3
MEMORY_BATCH, MEMORY_SEQ_LEN = 4, 64
LAB = TrainConfig()  # the lab's shape: 60 steps, batch 8 x 128, stopped at 30
STOP_AT = 30


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors`: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def worker(data: Path, shard: str, out: Path) -> None:
    """Under torchrun: train a few steps, then write this rank's memory to OUT/memory-rank-R.json."""
    from exactresume.core.data import load_tokens
    from exactresume.parallel.replicas import process_group
    from exactresume.parallel.replicate import replicate
    from exactresume.training.loop import build_run, train
    from exactresume.world import World

    config = TrainConfig(preset=MEMORY_PRESET, batch=MEMORY_BATCH, seq_len=MEMORY_SEQ_LEN, shard=shard)
    with process_group(World.from_env()) as world:
        run = build_run(config, load_tokens(data))
        replicate(run, world)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the unsharded model's freed pages back first
        setup = rss_bytes()
        reset_peak_rss()
        train(run, MEMORY_STEPS)
        params = list(run.model.parameters())
        moments = [value for state in run.optimizer.state.values() for value in state.values() if value.dim() > 0]
        figures = {
            "rank": world.rank,
            "weights_bytes": local_bytes(params),
            "gradient_bytes": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_bytes": local_bytes(moments),
            "setup_rss_bytes": setup,
            "training_peak_rss_bytes": peak_rss_bytes(),
        }
        (out / f"memory-rank-{world.rank}.json").write_text(json.dumps(figures) + "\n")


FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def memory_on(nproc: int, shard: str, data: Path, out: Path, malloc: dict[str, str] | None = None) -> dict:
    """The ranks' memory figures of one torchrun launch: the largest of each over the ranks."""
    folder = out / f"memory-{shard}-{nproc}{'-fixed' if malloc else ''}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "bench.fsdp", "--worker", shard, "--data", str(data), "--out", str(folder)]
    env = os.environ | {"OMP_NUM_THREADS": "1"} | (malloc or {})
    subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    ranks = [json.loads(path.read_text()) for path in sorted(folder.glob("memory-rank-*.json"))]
    assert len(ranks) == nproc, f"{len(ranks)} of {nproc} ranks reported"
    keys = ("weights_bytes", "gradient_bytes", "optimizer_bytes", "setup_rss_bytes", "training_peak_rss_bytes")
    largest = {key: max(rank[key] for rank in ranks) for key in keys}
    settings = " ".join(f"{name}={value}" for name, value in (malloc or {}).items())
    return {"processes": nproc, "shard": shard, "malloc": settings, **largest}


def exactresume(*args: object) -> None:
    command = [sys.executable, "-m", "exactresume.cli", *map(str, args)]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode:
        raise RuntimeError(f"exactresume {' '.join(map(str, args))} exited {finished.returncode}:\n{finished.stderr}")


def train(out: Path, data: Path, nproc: int, *flags: object) -> None:
    exactresume("train", "--data", data, "--out", out, "--shard", "fsdp", "--nproc", nproc, *flags)


def resume_on(source: Path, nproc: int, out: Path, data: Path, straight: Path) -> dict:
    """`source`'s resume.dcp resumed on `nproc` processes, against the straight run it continues."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / "resume.dcp", out / "resume.dcp", dirs_exist_ok=True)
    train(out, data, nproc, "--resume", out / "resume.dcp", "--samples", out / "samples.csv")
    resumed, reference = read_samples(out / "samples.csv"), read_samples(straight / "samples.csv")
    mine, theirs = read_weights(out / "final.pth")[0], read_weights(straight / "final.pth")[0]
    return {
        "same_samples": resumed == {step: reference[step] for step in resumed},
        "steps_resumed": len(resumed),
        "bit_identical": mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine),
        **weight_distance(mine, theirs),
    }


def resharding(data: Path, out: Path) -> dict:
    for n in (1, 2):
        train(out / f"straight{n}", data, n, "--samples", out / f"straight{n}" / "samples.csv")
        train(out / f"stop{n}", data, n, "--stop-at", STOP_AT)
    straight = {n: out / f"straight{n}" for n in (1, 2)}
    return {
        "two_to_two": resume_on(out / "stop2", 2, out / "two_to_two", data, straight[2]),
        "two_to_one": resume_on(out / "stop2", 1, out / "two_to_one", data, straight[2]),
        "two_to_four": resume_on(out / "stop2", 4, out / "two_to_four", data, straight[2]),
        "one_to_two": resume_on(out / "stop1", 2, out / "one_to_two", data, straight[1]),
        "straight_1_vs_2": weight_distance(
            read_weights(straight[1] / "final.pth")[0], read_weights(straight[2] / "final.pth")[0]
        ),
    }


def measure(data: Path, out: Path) -> dict:
    load_before = load_average()
    layouts = [(1, "fsdp"), (2, "fsdp"), (4, "fsdp"), (2, "none")]
    memory = [memory_on(n, shard, data, out, malloc) for malloc in (None, FIXED_MMAP_THRESHOLD) for n, shard in layouts]
    return {
        "memory": {
            "preset": MEMORY_PRESET,
            "batch": MEMORY_BATCH,
            "seq_len": MEMORY_SEQ_LEN,
            "per_rank": memory,
        },
        "resumes": {"steps": LAB.steps, "stop_at": STOP_AT, "batch": LAB.batch, "seq_len": LAB.seq_len}
        | resharding(data, out),
        "load_average": [load_before, load_average()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/kjv"))
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp"))
    parser.add_argument("--worker", choices=("fsdp", "none"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.data, args.worker, args.out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    figures = measure(args.data, args.out)
    (args.out / "fsdp.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
