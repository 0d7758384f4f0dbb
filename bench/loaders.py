"""What a `ResumableLoader` part costs a user's loop: per step, per save, and at the resume itself.

Step: `steps` training steps of a small MLP over a shuffled DataLoader, iterated through the part,
against the same steps over the bare loader (a new epoch's iterator each round); Iterate: the same
batches with no training at all, where the part's own work is the largest share it can be.
Save: `CheckpointStore.save` of the model, optimizer, GlobalRng and the part against the same save
without the part. Resume: the first batch after loading a position half an epoch in (the part skips
that many index lists) against an epoch's first batch without a load. All figures are ratios of
rounds measured one after the other in the same run (bench/measure.py).

    python -m bench.loaders --reps 7              # printed as JSON, and written to runs/bench-loaders/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from exactresume.loaders.resumable import ResumableLoader
from exactresume.parts import GlobalRng
from exactresume.store.numbered import CheckpointStore

from .measure import interleave, ratio, timed

SAMPLES, FEATURES, BATCH = 65536, 64, 32  # 2048 batches an epoch: a resume half-way skips 1024


def build(workers: int) -> tuple[DataLoader, torch.nn.Module, torch.optim.Optimizer]:
    dataset = TensorDataset(torch.randn(SAMPLES, FEATURES))
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return loader, model, torch.optim.AdamW(model.parameters())


def stepping(batches, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int):
    def trial() -> float:
        def run() -> None:
            iterator = iter(batches)
            for _, (features,) in zip(range(steps), iterator):
                loss = model(features).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        return timed(run)

    return trial


def iterating(batches, count: int):
    """The loader alone: `count` batches and nothing else, so the part's own work is not lost in training's."""

    def trial() -> float:
        return timed(lambda: [batch for _, batch in zip(range(count), iter(batches))])

    return trial


def saving(folder: Path, parts: dict):
    shutil.rmtree(folder, ignore_errors=True)
    store, step = CheckpointStore(folder, keep=1), [0]

    def trial() -> float:
        step[0] += 1
        return timed(lambda: store.save(step[0], parts))

    return trial


def first_batch(part: ResumableLoader, state: dict | None):
    def trial() -> float:
        def run() -> None:
            if state is not None:
                part.load_state_dict(state)
            next(iter(part))

        return timed(run)

    return trial


def figures(folder: Path, reps: int, steps: int, workers: int) -> dict:
    loader, model, optimizer = build(workers)
    part = ResumableLoader(loader)
    step_times = interleave(
        {"bare": stepping(loader, model, optimizer, steps), "part": stepping(part, model, optimizer, steps)}, reps
    )
    iterate_times = interleave({"bare": iterating(loader, steps), "part": iterating(part, steps)}, reps)
    parts = {"model": model, "optimizer": optimizer, "rng": GlobalRng()}
    save_times = interleave(
        {"bare": saving(folder / "bare", parts), "part": saving(folder / "part", parts | {"loader": part})}, reps
    )
    halfway = ResumableLoader(loader)
    batches = iter(halfway)
    for _ in range(len(loader) // 2):
        next(batches)
    resume_times = interleave(
        {"fresh": first_batch(ResumableLoader(loader), None), "resumed": first_batch(part, halfway.state_dict())},
        reps,
    )
    return {
        "step_ratio": ratio(step_times["part"], step_times["bare"]),
        "iterate_ratio": ratio(iterate_times["part"], iterate_times["bare"]),
        "save_ratio": ratio(save_times["part"], save_times["bare"]),
        "resume_first_batch_ratio": ratio(resume_times["resumed"], resume_times["fresh"]),
        "settings": {"samples": SAMPLES, "batch": BATCH, "steps": steps, "workers": workers, "reps": reps}
        | {"threads": torch.get_num_threads()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-loaders"), help="folder for loaders.json")
    parser.add_argument("--reps", type=int, default=7, help="measured rounds per figure (after one warm-up)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per step round")
    parser.add_argument("--workers", type=int, default=0, help="the loader's num_workers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steadier on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    result = figures(args.out / "scratch", args.reps, args.steps, args.workers)
    shutil.rmtree(args.out / "scratch", ignore_errors=True)
    (args.out / "loaders.json").write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
