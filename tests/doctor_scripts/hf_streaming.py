"""Hugging Face `datasets` streaming, as its docs show it: an in-memory dataset made iterable in shards,
shuffled through a buffer (`shuffle(seed=, buffer_size=)`), `set_epoch` each epoch, fed to a torch
DataLoader. The checkpoint holds the model, the optimizer and the step; with --save-state also the
dataset's `state_dict()`, which `load_state_dict()` restores on resume. That restores the shards' position
but not the shuffle buffer's content (datasets refills the buffer). --shuffle-first shuffles the map-style
Dataset before to_iterable_dataset() instead of through a buffer (the fix the doctor names)."""

import argparse
import os
import shutil

import torch
from datasets import Dataset
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--save-state", action="store_true", help="save ds.state_dict() and load it on resume")
parser.add_argument("--shuffle-first", action="store_true", help="Dataset.shuffle(seed=), no buffer")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)

index = torch.arange(48, dtype=torch.float32)
rows = {"x": [torch.sin(index[i] * 0.37 + torch.arange(8.0)).tolist() for i in range(48)]}
rows["y"] = [[sum(x) * 0.1] for x in rows["x"]]
if args.shuffle_first:
    ds = Dataset.from_dict(rows).shuffle(seed=42).to_iterable_dataset(num_shards=4)
else:
    ds = Dataset.from_dict(rows).to_iterable_dataset(num_shards=4).shuffle(seed=42, buffer_size=8)
ds = ds.with_format("torch")
loader = DataLoader(ds, batch_size=4)

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, epoch, batches = os.path.join(args.out, "resume.pt"), 0, 0, []
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step, epoch = state["step"], state["epoch"]
    if args.save_state:
        ds.load_state_dict(state["dataset"])

while step < args.steps:
    ds.set_epoch(epoch)
    for batch in loader:
        batches.append(batch["x"].clone())
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch}
            if args.save_state:
                state["dataset"] = ds.state_dict()
            torch.save(state, path)
            if args.record:  # each save's checkpoint kept, for the resume by hand
                shutil.copyfile(path, f"{path}.{step}")
        if step == args.steps:
            break
    else:
        epoch += 1
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
