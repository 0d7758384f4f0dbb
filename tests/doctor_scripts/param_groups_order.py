"""Bug: the optimizer's param groups (weight decay on the encoder, none on the head) are built in one order
for a fresh run and in the other by the resume path, so optimizer.load_state_dict(), which matches groups
and parameters by position, puts the encoder's moments on the head's parameters and the other way round.
--fixed builds them in the same order on both paths."""

import argparse
import os
import shutil

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--fixed", action="store_true")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.randn(64, 8)
targets = data.sum(1, keepdim=True) * 0.1
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def optimizer_for(model, head_first: bool):
    encoder = {"params": list(model[0].parameters()), "weight_decay": 0.1}
    head = {"params": list(model[2].parameters()), "weight_decay": 0.0}
    groups = [head, encoder] if head_first else [encoder, head]
    groups.append({"params": list(model[3].parameters()), "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=1e-2)


path, step, batches = os.path.join(args.out, "resume.pt"), 0, []
if args.resume:
    optimizer = optimizer_for(model, head_first=not args.fixed)
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
else:
    optimizer = optimizer_for(model, head_first=False)

while step < args.steps:
    x, y = data[step * 8 % 64 :][:8], targets[step * 8 % 64 :][:8]
    batches.append(x.clone())
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        if args.record:  # each save's checkpoint kept, for the resume by hand
            shutil.copyfile(path, f"{path}.{step}")
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
