"""Bug: the script sets a cosine lr by hand from the loop's own counter, which restarts at 0 after a
resume, instead of the global step it restored."""

import argparse
import math
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batches = torch.Generator().manual_seed(1)
path, start = os.path.join(args.out, "resume.pt"), 0
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    batches.set_state(state["batches"])
    start = state["step"]

for i in range(args.steps - start):
    step = start + i + 1
    for group in optimizer.param_groups:
        group["lr"] = 1e-2 * 0.5 * (1 + math.cos(math.pi * i / args.steps))
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "batches": batches.get_state()}
        torch.save(state | {"step": step}, path)
