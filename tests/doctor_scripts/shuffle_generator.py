"""Bug: DataLoader(shuffle=True, generator=g) resumed mid-epoch by skipping batches, with g's state not
saved: the fresh g replays the first epoch's order, not the order of the epoch the run was in."""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
path, step = os.path.join(args.out, "resume.pt"), 0
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]

skip = step % len(loader)
while step < args.steps:
    for x, y in loader:
        if skip:
            skip -= 1
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        if step == args.steps:
            break
