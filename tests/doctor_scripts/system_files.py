"""Correct, and it writes where no checkpoint goes: /dev/null (a logger's sink, a child's output), a
FIFO, and a cache folder of its own in the temp folder (as torch.compile's and multiprocessing's are)."""

import argparse
import os
import subprocess

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--cache", required=True)
parser.add_argument("--fifo", required=True)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batches = torch.Generator().manual_seed(1)
path, step = os.path.join(args.out, "resume.pt"), 0

with open(os.devnull, "w") as sink:
    sink.write("a logger that prints nowhere\n")
subprocess.run(["true"], stdout=subprocess.DEVNULL, check=True)
if not os.path.exists(args.fifo):
    os.mkfifo(args.fifo)
with open(args.fifo, "r+b", buffering=0) as pipe:  # read and write: opening it never waits for a reader
    pipe.write(b"started\n")
os.makedirs(os.path.join(args.cache, "entries"), exist_ok=True)
with open(os.path.join(args.cache, "entries", "kernel.bin"), "wb") as entry:
    entry.write(b"compiled once")

if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    batches.set_state(state["batches"])
    step = state["step"]

while step < args.steps:
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "batches": batches.get_state()}
        torch.save(state | {"step": step}, path)
