"""Bug: a loop that resumes at the saved step instead of the one after it. It counts its steps from 0 and
saves the number of the step it has just trained; the resume starts the loop at that number, so the
first resumed step trains that step's batch again. --fixed starts at the one after."""

import argparse
import os
import shutil

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--fixed", action="store_true", help="resume at the step after the saved one")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, start, batches = os.path.join(args.out, "resume.pt"), 0, []
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"] + 1 if args.fixed else state["step"]
for step in range(start, args.steps):
    rows = slice(step % 8 * 8, step % 8 * 8 + 8)
    x, y = inputs[rows], targets[rows]
    batches.append(x.clone())
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if (step + 1) % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        if args.record:  # each save's checkpoint kept, for the resume by hand
            shutil.copyfile(path, f"{path}.{step + 1}")
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
