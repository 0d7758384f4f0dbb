"""Correct: a RandomSampler whose generator is reseeded from the seed and the epoch as each epoch begins
(the order is a function of both, as DistributedSampler's is), resumed mid-epoch by reseeding it the same
way and skipping the batches already seen. The checkpoint holds the step, not the generator's state: it
rebuilds that state from saved values. --scaler trains through a GradScaler whose state is not saved: a
bug of another kind, under which the generator is still restored. --dropout-rng gives the model a dropout and
saves torch's RNG, but sets it back after the epoch's iterator is made (which draws the workers' base seed
from it): resumed at an epoch's end (--batch 6: 4 batches an epoch), the straight run made that iterator
after the save, so the dropout masks differ."""

import argparse
import os

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--scaler", action="store_true", help="a GradScaler, its state not saved")
parser.add_argument("--dropout-rng", action="store_true", help="a dropout; the RNG set back after iter()")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
seed, generator = 1, torch.Generator()
data = TensorDataset(torch.randn(24, 8), torch.randn(24, 1))
loader = DataLoader(data, batch_size=args.batch, sampler=RandomSampler(data, generator=generator))
dropout = [torch.nn.Dropout(0.1)] if args.dropout_rng else []
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), *dropout, torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=args.scaler)
step, batches = 0, []
if args.resume:  # the newest of the checkpoints kept, one a save: OUT/step-N.pt
    newest = max(os.listdir(args.out), key=lambda name: int(name.removeprefix("step-").removesuffix(".pt")))
    state = torch.load(os.path.join(args.out, newest), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]

while step < args.steps:
    epoch, skip = divmod(step, len(loader))
    generator.manual_seed(seed + epoch)
    batches_of_epoch = iter(loader)
    if args.dropout_rng and args.resume and "rng" in state:
        torch.set_rng_state(state.pop("rng"))  # after iter(): the bug
    for x, y in batches_of_epoch:
        if skip:
            skip -= 1
            continue
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            if args.dropout_rng:
                state["rng"] = torch.get_rng_state()
            torch.save(state, os.path.join(args.out, f"step-{step}.pt"))
        if step == args.steps:
            break
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
