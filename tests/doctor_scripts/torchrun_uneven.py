"""torchrun, two ranks, each training a model of its own (no process group): rank 1 stops two steps
before rank 0. The doctor cannot compare ranks that disagree on the step count."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
rank = int(os.environ["RANK"])
torch.manual_seed(rank)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(1, args.steps + 1 - 2 * rank):
    loss = model(torch.randn(8, 4)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 2 == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.out, f"rank{rank}.pt"))
