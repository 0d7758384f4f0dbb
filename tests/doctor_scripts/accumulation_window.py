"""Bug: two micro-batches per optimizer step, and a checkpoint every 3 micro-batches: some land inside
an accumulation window, whose gradients the file does not hold; a resume cuts the window in two."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--accum", type=int, default=2)
parser.add_argument("--save-every", type=int, default=3, help="in micro-batches")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, micro = os.path.join(args.out, "resume.pt"), 0
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    micro = state["micro"]

while micro < args.steps * args.accum:
    rows = slice(4 * micro % 64, 4 * micro % 64 + 4)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]) / args.accum
    loss.backward()
    micro += 1
    if micro % args.accum == 0:
        optimizer.step()
        optimizer.zero_grad()
    if micro % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "micro": micro}, path)
