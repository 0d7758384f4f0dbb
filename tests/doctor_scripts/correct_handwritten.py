"""Correct: model, optimizer, LR scheduler, batch generator, RNG (for the dropout) and step, all in one file.

--folders: each checkpoint a folder of its own, OUT/step-N, published over any older one at once as
exactresume's lines publish theirs (atomic.replace_folder); the resume takes the newest."""

import argparse
import os
from pathlib import Path

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--folders", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
batches = torch.Generator().manual_seed(1)
path, step = os.path.join(args.out, "resume.pt"), 0


def newest_folder() -> str:
    steps = [int(name.removeprefix("step-")) for name in os.listdir(args.out) if name.startswith("step-")]
    return os.path.join(args.out, f"step-{max(steps)}", "resume.pt")


def publish(state: dict, step: int) -> None:
    from exactresume.atomic import replace_folder

    staging = Path(args.out, f".staging-{step}")
    staging.mkdir()
    torch.save(state, staging / "resume.pt")
    replace_folder(staging, Path(args.out, f"step-{step}"))


if args.resume:
    state = torch.load(newest_folder() if args.folders else path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
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
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "batches": batches.get_state(),
            "rng": torch.get_rng_state(),
            "step": step,
        }
        publish(state, step) if args.folders else torch.save(state, path)
