"""Bug: the resume restores the trained weights, the optimizer and the step, but not all the forward reads.

--case ema: a mean-teacher loss reads an exponential moving average of the model (run without gradients,
updated after each step); the checkpoint lacks it and the resume rebuilds it from the resumed weights
(--save-ema saves and loads it).
--case batchnorm: the model has BatchNorm layers and the checkpoint holds only its parameters
(named_parameters()), not its running statistics (--full saves model.state_dict()).
"""

import argparse
import copy
import os
import shutil

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--case", choices=("ema", "batchnorm"), default="ema")
parser.add_argument("--save-ema", action="store_true")
parser.add_argument("--full", action="store_true", help="save model.state_dict(), buffers included")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.randn(64, 8)
targets = data.sum(1, keepdim=True) * 0.1
if args.case == "batchnorm":
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
else:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, batches = os.path.join(args.out, "resume.pt"), 0, []
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"], strict=args.case != "batchnorm" or args.full)
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
ema = copy.deepcopy(model).requires_grad_(False)  # rebuilt from the (resumed) weights
if args.resume and args.save_ema:
    ema.load_state_dict(state["ema"])


def loss_of(x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if args.case == "ema":  # the mean teacher: the model's output pulled toward the average's
        with torch.no_grad():
            target = ema(x)
        loss = loss + 0.5 * torch.nn.functional.mse_loss(model(x), target)
    return loss


while step < args.steps:
    x, y = data[step * 8 % 64 :][:8], targets[step * 8 % 64 :][:8]
    batches.append(x.clone())
    loss = loss_of(x, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for average, p in zip(ema.parameters(), model.parameters()):
            average.lerp_(p, 0.1)
    step += 1
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        weights = model.state_dict() if args.full else dict(model.named_parameters())
        state = {"model": weights, "optimizer": optimizer.state_dict(), "step": step}
        if args.save_ema:
            state["ema"] = ema.state_dict()
        torch.save(state, path)
        if args.record:  # each save's checkpoint kept, for the resume by hand
            shutil.copyfile(path, f"{path}.{step}")
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
