"""A user's loop over a loader of one kind, stopped at a step or killed, resumed from its store.

    python loader_run.py FOLDER KIND [--stop STEP] [--every-step] [--kill-at STEP SECONDS] [--bare] [--workers N]

Three epochs of a tiny model with dropout and AdamW, one optimizer step a batch. It loads the newest
checkpoint of FOLDER/checkpoints, if any, saves at --stop (and after every step with --every-step),
and when the run is over writes FOLDER/out.pt: every step's sample numbers (those of the steps before
the resume come from the checkpoint's `record` part) and the final weights. --bare saves the loader
the way a user would without exactresume: GeneratorPart(generator) over a DataLoader, or torchdata's
StatefulDataLoader itself as the part. --workers gives the loader N worker processes instead of its kind's
(persistent ones only where N is above 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from exactresume import CheckpointStore, GeneratorPart, GlobalRng, ResumableLoader, StepCounter

EPOCHS = 3


class Numbered(Dataset):
    """Sample i: (i, four features made from i)."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return index, torch.arange(4, dtype=torch.float32) * (index + 1) / 10


class Augmented(Numbered):
    """Numbered's samples plus noise drawn from the RNG of the worker that reads them (random augmentation)."""

    def __getitem__(self, index: int):
        number, features = super().__getitem__(index)
        return number, features + torch.rand(4)


class SeededAugmented(Numbered):
    """Numbered's samples plus noise seeded by the sample's index and the epoch, as docs/loaders.md says:
    the loop sets `epoch` before each epoch, in shared memory, so persistent workers read it too."""

    def __init__(self, length: int):
        super().__init__(length)
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __getitem__(self, index: int):
        number, features = super().__getitem__(index)
        noise = torch.Generator().manual_seed(hash((5, int(self.epoch), index)))
        return number, features + torch.rand(4, generator=noise)


class Counting(IterableDataset):
    """Samples 0..length-1 in order, as Numbered's; each worker none (used with num_workers=0)."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        return (Numbered(self.length)[index] for index in range(self.length))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def build(kind: str, workers: int | None = None) -> DataLoader:
    """13 batches an epoch, each kind of loader users iterate (with `workers` processes, if given)."""
    loader = _build(kind)
    if workers is None:
        return loader
    persistent = loader.persistent_workers and workers > 0
    return type(loader)(
        loader.dataset, batch_size=2, shuffle=True, drop_last=loader.drop_last, generator=loader.generator,
        num_workers=workers, persistent_workers=persistent,
    )  # fmt: skip


def _build(kind: str) -> DataLoader:
    if kind == "distributed":  # rank 1 of 2: 26 of 52 samples
        return DataLoader(Numbered(52), batch_size=2, sampler=DistributedSampler(Numbered(52), 2, 1, seed=3))
    return {
        "shuffle": lambda: DataLoader(Numbered(26), batch_size=2, shuffle=True),
        "generator": lambda: DataLoader(Numbered(27), batch_size=2, shuffle=True, drop_last=True, generator=seeded(7)),
        "workers": lambda: DataLoader(Numbered(26), batch_size=2, shuffle=True, num_workers=2),
        "persistent": lambda: DataLoader(
            Numbered(26), batch_size=2, shuffle=True, generator=seeded(7), num_workers=2, persistent_workers=True
        ),
        "per-sample": lambda: DataLoader(Numbered(13), batch_size=None, shuffle=True),
        "stateful": lambda: StatefulDataLoader(
            Numbered(26), batch_size=2, shuffle=True, generator=seeded(7), num_workers=2
        ),
        "augmented": lambda: DataLoader(Augmented(26), batch_size=2, shuffle=True, num_workers=2),
        "augmented-seeded": lambda: DataLoader(
            SeededAugmented(26), batch_size=2, shuffle=True, generator=seeded(7), num_workers=2, persistent_workers=True
        ),
        "stateful-persistent": lambda: StatefulDataLoader(
            Numbered(26), batch_size=2, shuffle=True, generator=seeded(7), num_workers=2, persistent_workers=True
        ),
        "stateful-main": lambda: StatefulDataLoader(Numbered(26), batch_size=2, shuffle=True, generator=seeded(7)),
        "stateful-global": lambda: StatefulDataLoader(Numbered(26), batch_size=2, shuffle=True),
        "iterable": lambda: DataLoader(Counting(26), batch_size=2),
    }[kind]()


class Record:
    """The sample numbers of every step so far, as a part: a resumed run's record starts with the saved."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def state_dict(self) -> dict:
        return {"steps": list(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = list(state["steps"])


def train_step(model, optimizer, batch) -> None:
    numbers, features = batch
    loss = model(features.reshape(-1, 4)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run(folder: Path, kind: str, stop: int | None, every_step: bool, bare: bool, kill_at=None, workers=None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    source = build(kind, workers)
    loader = source if bare else ResumableLoader(source)
    step, record = StepCounter(), Record()
    parts = {"model": model, "optimizer": optimizer, "rng": GlobalRng(), "step": step, "record": record}
    parts["loader"] = GeneratorPart(source.generator) if bare and not hasattr(source, "state_dict") else loader
    store = CheckpointStore(folder / "checkpoints", keep=2)
    store.load(parts)
    for batch in batches(loader, source, step, bare):
        if kill_at is not None and step.value + 1 == int(kill_at[0]):  # SIGKILL somewhere in this step or its save
            threading.Timer(kill_at[1], os.kill, (os.getpid(), signal.SIGKILL)).start()
        train_step(model, optimizer, batch)
        step.value += 1
        record.steps.append(torch.as_tensor(batch[0]).clone())
        if every_step or step.value == stop:
            store.save(step.value, parts)
        if step.value == stop:
            return
    torch.save({"steps": record.steps, "weights": model.state_dict()}, folder / "out.pt")


def batches(loader, source: DataLoader, step: StepCounter, bare: bool):
    """The loop's batches: epochs as a user with a ResumableLoader writes them, or, bare, as one without
    (every pass over the loader as it was restored, until the run's steps are done)."""
    if not bare:
        while loader.epoch < EPOCHS:
            if isinstance(source.sampler, DistributedSampler):
                source.sampler.set_epoch(loader.epoch)
            if isinstance(source.dataset, SeededAugmented):
                source.dataset.epoch.fill_(loader.epoch)
            yield from loader
        return
    total = EPOCHS * len(source)
    while step.value < total:
        for batch in loader:
            yield batch
            if step.value == total:
                return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("kind")
    parser.add_argument("--stop", type=int)
    parser.add_argument("--every-step", action="store_true")
    parser.add_argument(
        "--kill-at", nargs=2, type=float, metavar=("STEP", "SECONDS"), help="SIGKILL this long after STEP begins"
    )
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--workers", type=int)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13, at every loader
    run(args.folder, args.kind, args.stop, args.every_step, args.bare, args.kill_at, args.workers)


if __name__ == "__main__":
    main()
