"""Bug: the checkpoint has no optimizer state; a resume starts AdamW afresh (moments and step at zero)."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--lr-as-built", action="store_true", help="resume without setting the scheduler's lr back")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
batches = torch.Generator().manual_seed(1)
path, step = os.path.join(args.out, "resume.pt"), 0

if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    scheduler.load_state_dict(state["scheduler"])
    for group in optimizer.param_groups if not args.lr_as_built else ():
        group["lr"] = scheduler.get_last_lr()[0]
    batches.set_state(state["batches"])
    torch.set_rng_state(state["rng"])
    step = state["step"]

while step < args.steps:
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    step += 1
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "scheduler": scheduler.state_dict(),
            "batches": batches.get_state(),
            "rng": torch.get_rng_state(),
            "step": step,
        }
        torch.save(state, path)
