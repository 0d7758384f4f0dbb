"""Bug: random augmentation drawn from numpy, whose state the checkpoint does not hold. The checkpoint keeps
the model, the optimizer, the torch RNG and the loader's generator as the epoch began (the resume skips the
batches already seen: the data position is right), not numpy's state, so the resumed steps read the same
samples with other noise. --source says where the noise is drawn: `global` (np.random.normal, numpy's
global RNG, in the loop), `generator` (a numpy Generator from default_rng, kept as an Augment object's
`rng`), `workers` (in the dataset's __getitem__, in two worker processes whose numpy worker_init_fn seeds
from the worker's torch seed: exact, for the workers read the skipped batches again with the same seeds).
--no-shuffle reads the samples in order. --fixed saves numpy's state and sets it back. --rebuild (with
workers) resumes through a new loader over the epoch's batches not yet taken: the same samples, read by
workers seeded anew, so other noise."""

import argparse
import os
import shutil

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--source", choices=("global", "generator", "workers"), default="global")
parser.add_argument("--no-shuffle", action="store_true")
parser.add_argument("--rebuild", action="store_true", help="resume through a loader over the batches left")
parser.add_argument("--fixed", action="store_true", help="save numpy's state and set it back")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
np.random.seed(0)


class Samples(Dataset):
    def __init__(self, noisy: bool):
        self.x, self.y, self.noisy = torch.randn(24, 8), torch.randn(24, 1), noisy

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index]
        if self.noisy:  # in a worker: its numpy, seeded by seed_worker
            x = x + torch.from_numpy(np.random.normal(0, 0.1, 8).astype(np.float32))
        return x, self.y[index]


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


class Augment:
    def __init__(self):
        self.rng = np.random.default_rng(3)

    def __call__(self, x):
        return x + torch.from_numpy(self.rng.normal(0, 0.1, tuple(x.shape)).astype(np.float32))


def noise(x):
    if args.source == "global":
        return x + torch.from_numpy(np.random.normal(0, 0.1, tuple(x.shape)).astype(np.float32))
    if args.source == "generator":
        return augment(x)
    return x


def numpy_state():
    if args.source == "generator":
        return augment.rng.bit_generator.state
    name, keys, position, has_gauss, gauss = np.random.get_state()
    return [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]


def set_numpy_state(state):
    if args.source == "generator":
        augment.rng.bit_generator.state = state
    else:
        name, keys, position, has_gauss, gauss = state
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))


augment = Augment()
workers = {"num_workers": 2, "worker_init_fn": seed_worker} if args.source == "workers" else {}
generator = torch.Generator().manual_seed(1)
data = Samples(noisy=args.source == "workers")
loader = DataLoader(data, batch_size=8, shuffle=not args.no_shuffle, generator=generator, **workers)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, batches, raw, epoch_start = os.path.join(args.out, "resume.pt"), 0, [], [], None
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    epoch_start, step = state["epoch_start"], state["step"]
    if args.fixed and args.source != "workers":
        set_numpy_state(state["numpy"])
while step < args.steps:
    skip = step % len(loader)
    if epoch_start is not None:  # resuming: the loader's generator as this epoch began
        generator.set_state(epoch_start)
    epoch_start = generator.get_state()
    epoch_loader = loader
    if args.rebuild and skip:  # the epoch's index lists, drawn as the loader draws them (its base seed first)
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        left = list(loader.batch_sampler)[skip:]
        epoch_loader, skip = DataLoader(data, batch_sampler=left, **workers), 0
    for x, y in epoch_loader:
        if skip:
            skip -= 1
            continue
        raw.append(y.clone())  # the samples read: their targets, which no noise touches
        x = noise(x)
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            state |= {"rng": torch.get_rng_state(), "epoch_start": epoch_start}
            if args.fixed and args.source != "workers":
                state["numpy"] = numpy_state()
            torch.save(state, path)
            if args.record:  # each save's checkpoint kept, for the resume by hand
                shutil.copyfile(path, f"{path}.{step}")
        if step == args.steps:
            break
    epoch_start = None
if args.record:
    torch.save({"batches": batches, "raw": raw, "weights": model.state_dict()}, args.record)
