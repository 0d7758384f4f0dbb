"""FSDP2's checkpoint on 2 processes, three ways: exactresume's sharded save, DCP's own, and one gathered file.

    python -m bench.sharded_save --preset minimind-26m --reps 5    # prints and writes runs/bench-sharded/sharded.json

Under torchrun (gloo, CPU), each rank builds the preset's model, shards it with FSDP2 as
`--shard fsdp` does, and takes one AdamW step so that its moments exist. Then, in interleaved
rounds (the order rotating, the first round a warm-up), the same state is saved:

    sharded    CheckpointStore(folder, sharded=True).save: each rank writes its shard through DCP,
               rank 0 writes the commit marker (every file's checksum) and reads it all back verified
    dcp        torch.distributed.checkpoint.save of the same state dicts into a folder
    gathered   the full state gathered on rank 0 (full_state_dict, on the CPU) and saved there as one
               sealed file, written and read back verified: the trainer's periodic save before it sharded

Each save's time is rank 0's, from the barrier before it to the barrier after it. The figures are the
median round-by-round ratios sharded / dcp (goal <= 1.0) and sharded / gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .measure import ratio

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.0


def _build(preset: str):
    import torch

    from exactresume.config import PRESETS
    from exactresume.core.model import MiniMindLM
    from exactresume.parallel.fsdp import ShardedReplicas
    from exactresume.world import World

    torch.manual_seed(0)
    model = MiniMindLM(PRESETS[preset])
    optimizer = torch.optim.AdamW(model.parameters())
    world = World.from_env()
    replicas = ShardedReplicas(model, optimizer, world)
    tokens = torch.randint(0, PRESETS[preset].vocab_size, (2, 33))
    replicas.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    return model, optimizer, world


def _trials(model, optimizer, world, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from exactresume import CheckpointStore
    from exactresume.parallel.fsdp import FullModel, FullOptimizer
    from exactresume.store.disk import write_verified

    parts = {"model": model, "optimizer": optimizer}
    target = {name: folder / name for name in ("sharded", "dcp", "gathered")}

    def sharded() -> None:
        with CheckpointStore(target["sharded"], keep=1, sharded=True, world=world) as store:
            store.save(1, parts)

    def own() -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(target["dcp"]))

    def gathered() -> None:
        state = {"model": FullModel(model).state_dict(), "optimizer": FullOptimizer(model, optimizer).state_dict()}
        if world.is_main:
            target["gathered"].mkdir()
            write_verified(target["gathered"] / "step-1.pth", state)

    return {"sharded": sharded, "dcp": own, "gathered": gathered}, target


def worker(preset: str, folder: Path, reps: int, out: Path) -> None:
    from exactresume.parallel.replicas import process_group
    from exactresume.world import World

    # gloo, as the trainer joins it: left to itself, FSDP2's device mesh takes nccl alone where CUDA is present
    with process_group(World.from_env()):
        model, optimizer, world = _build(preset)
        (trials, target), times = _trials(model, optimizer, world, folder), {}
        names = list(trials)
        for round_number in range(reps + 1):
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:
                if world.is_main:  # the last round's files go first, untimed: deleting 300 MB takes a tenth of a second
                    shutil.rmtree(target[name], ignore_errors=True)
                world.barrier()
                started = time.perf_counter()
                trials[name]()
                world.barrier()
                if round_number:
                    times.setdefault(name, []).append(time.perf_counter() - started)
        if world.is_main:
            out.write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FSDP2 saves on 2 processes: ours, DCP's, one gathered file.")
    parser.add_argument("--preset", default="minimind-26m")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-sharded"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    times_file = args.out / "times.json"
    if args.worker:
        worker(args.preset, args.out / "saves", args.reps, times_file)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    flags = ["-m", "bench.sharded_save", "--worker", "--preset", args.preset, "--reps", str(args.reps)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    subprocess.run([*launcher, *flags, "--out", str(args.out)], check=True, cwd=ROOT, env=env)
    times = json.loads(times_file.read_text())
    saves = args.out / "saves"
    sizes = {name: sum(path.stat().st_size for path in (saves / name).rglob("*") if path.is_file()) for name in times}
    dcp = ratio(times["sharded"], times["dcp"])
    figures = {
        "preset": args.preset,
        "processes": 2,
        "median_s": {name: sorted(values)[len(values) // 2] for name, values in times.items()},
        "bytes": sizes,
        "sharded_over_dcp": dcp | {"goal": f"<= {GOAL}", "met": dcp["ratio"] <= GOAL},
        "sharded_over_gathered": ratio(times["sharded"], times["gathered"]),
    }
    shutil.rmtree(args.out / "saves", ignore_errors=True)
    (args.out / "sharded.json").write_text(json.dumps(figures, indent=2) + "\n")
    json.dump(figures, sys.stdout, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
