"""Correct, and it goes through every hook of the tracer: a shuffled DataLoader with a generator of its
own, a dropout, AdamW with an LR scheduler and a GradScaler, every third step through a closure, the
RNG state set on resume, a checkpoint written to a temporary file then os.replace'd, a progress file
written with open(), the older one deleted, and at the end the last checkpoint read back and its RNG
state set (as a check). It prints each step's loss exactly (the tests compare the output with and
without the tracer) and ends with the exit code --exit-code gives."""

import argparse
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
order = torch.Generator().manual_seed(1)
loader = DataLoader(data, batch_size=8, shuffle=True, generator=order)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
scaler = torch.amp.GradScaler("cpu")
path, step, epoch_start = os.path.join(args.out, "resume.pt"), 0, order.get_state()

if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    order.set_state(state["epoch_start"])
    torch.set_rng_state(state["rng"])
    step = state["step"]


def save() -> None:
    os.makedirs(args.out, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch_start": epoch_start,
        "rng": torch.get_rng_state(),
        "step": step,
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    with open(os.path.join(args.out, "progress.json"), "w") as progress:
        json.dump({"step": step}, progress)
    older = os.path.join(args.out, f"loss-{step - args.save_every}.txt")
    if os.path.exists(older):
        os.remove(older)
    with open(os.path.join(args.out, f"loss-{step}.txt"), "w") as text:
        text.write(repr(loss.item()))


while step < args.steps:
    epoch_start = order.get_state()  # the order of this epoch, drawn as its iterator is made
    for index, (x, y) in enumerate(loader):
        if index < step % len(loader):  # the batches of this epoch the checkpoint had already taken
            continue

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if step % 3 == 2:
            loss = optimizer.step(closure)
        else:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        step += 1
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step % args.save_every == 0:
            save()
        if step == args.steps:
            break
state = torch.load(path, weights_only=True)
torch.set_rng_state(state["rng"])
print(f"read back the checkpoint of step {state['step']}: {torch.rand(1).item()!r}")
sys.exit(args.exit_code)
