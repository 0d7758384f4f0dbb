"""torchrun, two ranks over gloo, gradients averaged by hand: each rank shuffles its own half of the
data with its own seeded generator. Bug: rank 0 alone writes the checkpoint, with its own generator's
state at the epoch's start; on resume every rank sets that state, so rank 1 draws rank 0's order while
rank 0 resumes exactly."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--record", help="write each step's batch and the final weights here, per rank (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
order = torch.Generator().manual_seed(100 + rank)
loader = DataLoader(Subset(data, range(rank, 64, 2)), batch_size=8, shuffle=True, generator=order)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))  # one seed, every rank
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
step, batches = 0, []
if args.resume:  # the newest of the checkpoints kept, one a save: OUT/step-N.pt
    newest = max(os.listdir(args.out), key=lambda name: int(name.removeprefix("step-").removesuffix(".pt")))
    state = torch.load(os.path.join(args.out, newest), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    order.set_state(state["order"])  # rank 0's state, on every rank
    step = state["step"]

skip = step % len(loader)
while step < args.steps:
    epoch_start = order.get_state()
    for x, y in loader:
        if skip:
            skip -= 1
            continue
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        # By hand rather than with DDP: DDP's all-reduce, started inside backward, can abort a gloo rank
        # as Python shuts down (torch 2.13), whatever the script does at its end.
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
        optimizer.step()
        step += 1
        if step % args.save_every == 0 and rank == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state | {"order": epoch_start, "step": step}, os.path.join(args.out, f"step-{step}.pt"))
        if step == args.steps:
            break
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, f"{args.record}-{rank}.pt")
dist.destroy_process_group()
