"""torchdata's StatefulDataLoader, resumed as its docs show it: the checkpoint holds the loader's
state_dict() beside the model, the optimizer and the torch RNG, and the resume loads them all. With
--generator the loader draws its order from a generator of its own; without it, from the global torch
RNG. --workers N loads in N worker processes; --sampler gives it a RandomSampler rather than shuffle=True.
The model has a dropout, so a torch RNG state that is off shows in the gradients."""

import argparse
import os

import torch
from torch.utils.data import RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader, sampler

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--generator", action="store_true", help="give the loader a generator of its own")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--sampler", action="store_true", help="a RandomSampler passed as sampler=")
parser.add_argument("--fixed", action="store_true", help="the sampler's generator apart from the loader's")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
own = {"generator": torch.Generator().manual_seed(1)} if args.generator else {}
order = {"sampler": RandomSampler(data, **own)} if args.sampler else {"shuffle": True, **own}
if args.fixed:  # torchdata's own RandomSampler keeps its generator in the loader's state_dict()
    order = {"sampler": sampler.RandomSampler(data, generator=torch.Generator().manual_seed(1))}
    order["generator"] = torch.Generator().manual_seed(2)
loader = StatefulDataLoader(data, batch_size=8, num_workers=args.workers, **order)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
step, batches = 0, []
if args.resume:  # the newest of the checkpoints kept, one a save: OUT/step-N.pt
    newest = max(os.listdir(args.out), key=lambda name: int(name.removeprefix("step-").removesuffix(".pt")))
    state = torch.load(os.path.join(args.out, newest), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    step = state["step"]

while step < args.steps:
    for x, y in loader:
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}
            torch.save(state | {"rng": torch.get_rng_state(), "step": step}, os.path.join(args.out, f"step-{step}.pt"))
        if step == args.steps:
            break
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
