"""Correct, on exactresume's parts: CheckpointStore saves model, optimizer, scheduler, batch generator,
RNG and step as one sealed file per checkpoint, and restores the newest."""

import argparse

import torch

from exactresume import CheckpointStore, GeneratorPart, GlobalRng, StepCounter

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
batches, step = torch.Generator().manual_seed(1), StepCounter()
store = CheckpointStore(args.out, keep=2)
parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step}
parts |= {"batches": GeneratorPart(batches), "rng": GlobalRng()}
if args.resume:
    store.load(parts)

while step.value < args.steps:
    rows = torch.randint(0, 64, (8,), generator=batches)
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    step.value += 1
    if step.value % args.save_every == 0:
        store.save(step.value, parts)
