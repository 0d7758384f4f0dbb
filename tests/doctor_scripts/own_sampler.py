"""Bug: an order drawn from Python's `random`, whose state the checkpoint does not hold (it keeps the model,
the optimizer and the step; the resume skips the batches of the epoch already seen). --source says where:
`sampler`, a Sampler of the script's own that shuffles with a random.Random kept as its `rng`; `files`, a
loop of the script's own (no DataLoader) that random.shuffle()s a list of file names as each epoch begins.
The resume falls in the second epoch, whose order the resumed run draws from a fresh state. --fixed saves
the state as the epoch began (rng.getstate(), random.getstate()) and sets it back before the epoch's order
is drawn."""

import argparse
import os
import random
import shutil

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--source", choices=("sampler", "files"), default="sampler")
parser.add_argument("--fixed", action="store_true", help="save the order's random state as the epoch began")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
random.seed(0)


class ShuffleSampler(Sampler):
    def __init__(self, size: int, seed: int):
        self.size, self.rng = size, random.Random(seed)

    def __len__(self):
        return self.size

    def __iter__(self):
        order = list(range(self.size))
        self.rng.shuffle(order)
        return iter(order)


inputs, targets = torch.randn(24, 8), torch.randn(24, 1)
files = {f"sample-{i:03d}.pt": i for i in range(24)}  # a file's name -> the sample it holds
sampler = ShuffleSampler(24, seed=1)
loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, sampler=sampler)


def order_state():
    return sampler.rng.getstate() if args.source == "sampler" else random.getstate()


def set_order_state(state):
    sampler.rng.setstate(state) if args.source == "sampler" else random.setstate(state)


def epoch_batches():
    if args.source == "sampler":
        yield from loader
        return
    names = sorted(files)
    random.shuffle(names)
    for start in range(0, len(names), 8):
        rows = [files[name] for name in names[start : start + 8]]
        yield inputs[rows], targets[rows]


model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, batches, epoch_start = os.path.join(args.out, "resume.pt"), 0, [], None
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
    if args.fixed:
        epoch_start = tuple(state["order"])
while step < args.steps:
    skip = step % 3
    if epoch_start is not None:
        set_order_state(epoch_start)
    epoch_start = order_state()
    for x, y in epoch_batches():
        if skip:
            skip -= 1
            continue
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            if args.fixed:
                state["order"] = epoch_start
            torch.save(state, path)
            if args.record:  # each save's checkpoint kept, for the resume by hand
                shutil.copyfile(path, f"{path}.{step}")
        if step == args.steps:
            break
    epoch_start = None
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
