"""Bug: torch.distributed.checkpoint (DCP) saves the model's weights alone; a resume restarts the loop
with a fresh optimizer and schedule."""

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

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
folder = os.path.join(args.out, "model.dcp")
if args.resume:
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    model.load_state_dict(state)

for step in range(1, args.steps + 1):
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % args.save_every == 0:
        dcp.save(model.state_dict(), checkpoint_id=folder, no_dist=True)
