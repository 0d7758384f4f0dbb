"""Bug: the checkpoint is model.state_dict() alone; a resume restarts the loop with a fresh optimizer."""

import argparse
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
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
batches = torch.Generator().manual_seed(1)
path = os.path.join(args.out, "model.pt")
if args.resume:
    model.load_state_dict(torch.load(path, weights_only=True))

for step in range(1, args.steps + 1):
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), path)
