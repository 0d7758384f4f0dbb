"""Subtle: a DataLoader without generator= draws its workers' base seed from the global torch RNG each
time an iterator is made. The checkpoint holds the RNG state, and the resume restores it and only then
makes the iterator (skipping the batches already seen): that draw shifts every later dropout mask by
one, though the batches, weights and lr are all right. With --fixed, the fix the doctor names: the
DataLoader gets a generator of its own, and the resume is exact."""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--fixed", action="store_true", help="give the DataLoader its own generator")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
own = {"generator": torch.Generator().manual_seed(1)} if args.fixed else {}
loader = DataLoader(data, batch_size=8, **own)  # in order; no generator= unless --fixed
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
step, batches = 0, []
if args.resume:  # the newest of the checkpoints kept, one a save: OUT/step-N.pt
    newest = max(os.listdir(args.out), key=lambda name: int(name.removeprefix("step-").removesuffix(".pt")))
    state = torch.load(os.path.join(args.out, newest), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    step = state["step"]

skip = step % len(loader)
while step < args.steps:
    for x, y in loader:
        if skip:
            skip -= 1
            continue
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state | {"rng": torch.get_rng_state(), "step": step}, os.path.join(args.out, f"step-{step}.pt"))
        if step == args.steps:
            break
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
