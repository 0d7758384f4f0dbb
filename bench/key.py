"""What a key costs (store/seal_hash.py): a keyed save and load over the same save and load without one.

A run of each preset is trained one step (its AdamW moments exist), then, in interleaved rounds, its
resume state is saved into a store's folder as a periodic checkpoint is (`CheckpointStore.save`:
written, fsynced, renamed, read back verified) and loaded back (`load`: verified, then unpickled), once
sealed with xxh3 and once with the key's HMAC-SHA-256. Each figure is the median of the rounds'
keyed / unkeyed ratios. The goal: the MAC costs at most 5% of a save.

    python -m bench.key --presets default,minimind-26m --reps 5     # prints and writes runs/bench-key/key.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from exactresume import CheckpointStore
from exactresume.config import TrainConfig
from exactresume.core.data import ensure_data, load_tokens
from exactresume.training.loop import Run, build_run, train_step

from .measure import interleave, load_average, ratio, timed

KEY = "bench-key-" + "0" * 54
SAVE_GOAL = 1.05


def _parts(run: Run) -> dict:
    return {"model": run.model, "optimizer": run.optimizer}


def _save_trial(run: Run, folder: Path, key: str | None):
    def trial() -> float:
        shutil.rmtree(folder, ignore_errors=True)
        with CheckpointStore(folder, keep=1, key=key) as store:
            return timed(lambda: store.save(1, _parts(run)))

    return trial


def _load_trial(run: Run, folder: Path, key: str | None):
    def trial() -> float:
        with CheckpointStore(folder, keep=1, key=key) as store:
            return timed(lambda: store.load(_parts(run), clean=False))

    return trial


def bench_key(run: Run, out: Path, reps: int) -> dict:
    folders = {"keyed": out / "keyed", "unkeyed": out / "unkeyed"}
    keys = {"keyed": KEY, "unkeyed": None}
    saves = interleave({name: _save_trial(run, folders[name], keys[name]) for name in folders}, reps)
    loads = interleave({name: _load_trial(run, folders[name], keys[name]) for name in folders}, reps)
    size = next(folders["keyed"].glob("step-*")).stat().st_size
    save = ratio(saves["keyed"], saves["unkeyed"])
    return {
        "file_bytes": size,
        "save": save | {"goal": f"<= {SAVE_GOAL}", "met": save["ratio"] <= SAVE_GOAL},
        "load": ratio(loads["keyed"], loads["unkeyed"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A key's cost: keyed over unkeyed saves and loads.")
    parser.add_argument("--data", type=Path, default=Path("data/kjv"), help="prepared data (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-key"), help="folder for key.json")
    parser.add_argument("--presets", default="default,minimind-26m")
    parser.add_argument("--reps", type=int, default=5, help="measured rounds per figure (after one warm-up)")
    args = parser.parse_args(argv)
    ensure_data(args.data)
    tokens = load_tokens(args.data)
    figures: dict = {"load_average_before": load_average()}
    for preset in args.presets.split(","):
        run = build_run(TrainConfig(steps=10, batch=2, seq_len=64, preset=preset), tokens)
        train_step(run)
        figures[preset] = bench_key(run, args.out / preset, args.reps)
        shutil.rmtree(args.out / preset, ignore_errors=True)
    figures["settings"] = vars(args) | {"data": str(args.data), "out": str(args.out)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "key.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    json.dump(figures, sys.stdout, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
