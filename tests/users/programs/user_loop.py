"""A user's training loop, written from docs/library.md alone: a small model, AdamW, maybe an LR
scheduler, checkpoints every 10 steps in a CheckpointStore. Its flags play the versions of the
script a user writes over time (a part added or renamed, another width) and the mistakes they make.

    python user_loop.py FOLDER [--steps 30] [--parts model,opt] [--width 32] [--fresh sched] [--seed 0 --identity]
"""

import argparse
import sys

import torch

from exactresume import CheckpointStore, GeneratorPart, GlobalRng, UserError

flags = argparse.ArgumentParser()
flags.add_argument("folder")
flags.add_argument("--steps", type=int, default=30)
flags.add_argument("--parts", default="model,opt,data,rng")  # "optim" is the optimizer renamed, "sched" added
flags.add_argument("--width", type=int, default=32)
flags.add_argument("--fresh", default="")
flags.add_argument("--skip", default="")
flags.add_argument("--keep", type=int, default=3)
flags.add_argument("--seed", type=int, default=0)
flags.add_argument("--identity", action="store_true")  # the store is told the run's seed (identity=)
flags.add_argument("--start-over-on-error", action="store_true")  # catch the load's error and train from 0
flags.add_argument("--no-load", action="store_true")  # the script that forgot to resume
flags.add_argument("--ignore-save-errors", action="store_true")  # ... and that goes on when a save is refused
flags.add_argument("--save-step", type=int)  # one save at this step (a mistake like -1), then stop
flags.add_argument("--file-size-limit", type=int)  # the test's stand-in for a full disk: RLIMIT_FSIZE
args = flags.parse_args()

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(8, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
data = torch.Generator().manual_seed(1)
available = {"model": model, "opt": optimizer, "optim": optimizer, "sched": scheduler}
available |= {"data": GeneratorPart(data), "rng": GlobalRng()}
parts = {name: available[name] for name in args.parts.split(",")}
names = lambda text: [name for name in text.split(",") if name]  # noqa: E731
weights_before = [p.detach().clone() for p in model.parameters()]

try:
    store = CheckpointStore(args.folder, keep=args.keep, identity={"seed": args.seed} if args.identity else None)
    try:
        start = 0 if args.no_load else store.load(parts, skip=names(args.skip), fresh=names(args.fresh)) or 0
    except UserError as error:
        unchanged = all(torch.equal(a, b) for a, b in zip(weights_before, model.parameters()))
        print(f"load refused: {error}")
        print(f"model unchanged: {unchanged}")
        if not args.start_over_on_error:
            sys.exit(2)
        start = 0
    if args.file_size_limit:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, resource.RLIM_INFINITY))
    if args.save_step is not None:
        store.save(args.save_step, parts)
        sys.exit(0)
    for step in range(start + 1, args.steps + 1):
        inputs = torch.randn(16, 8, generator=data)
        loss = (model(inputs) - inputs.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if "sched" in parts:  # the second version of the script added a schedule
            scheduler.step()
        if step % 10 == 0:
            try:
                store.save(step, parts)
            except UserError as error:
                if not args.ignore_save_errors:
                    raise
                print(f"save refused: {error}")
except UserError as error:
    print(f"{type(error).__name__}: {error}")
    sys.exit(error.exit_code)
torch.save(model.state_dict(), f"{args.folder}/final.pt")
print(f"trained steps {start + 1} to {args.steps}")
