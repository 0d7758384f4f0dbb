"""A user's own loop under torchrun (gloo, 2 ranks, from docs/library.md "Many processes"): each rank
draws its own batches and its own global RNG stream, and the gradients are averaged by hand. Each
FOLDER:UNTIL:HOW is one run, trained (or resumed) up to step UNTIL, saved as HOW says:

- store: every rank calls `load` and `save` of one CheckpointStore given the run's world, every step;
- sharded-store: the same with `sharded=True`, every rank writing its shard of each checkpoint;
- file: every rank calls `save_resume(..., world=)` at UNTIL and `load_resume` (no world) at the start;
- sharded: `save_resume(..., sharded=True)` at UNTIL and `open_resume(...).restore` (no world);
- tiers: a store with a local tier, each rank its own (as on its own node; rank 0 writes), every 2nd step
  durable, each run ending as a lost node's would (no `close`, which would copy its last step durable):
  the ranks' tiers disagree at a resume, and every rank takes the durable tier's newest;
- shared-tiers: the same with one local tier for both ranks (one node): they agree on its newest.

Each rank writes FOLDER/end-RANK.pt: its weights and both generators' states.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ranks_loop.py FOLDER:UNTIL:HOW ...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from exactresume import CheckpointStore, GeneratorPart, GlobalRng, World, load_resume, open_resume, save_resume


def train(folder: Path, until: int, how: str, world: World) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(world.rank)  # each rank's own global stream from here on
    data = torch.Generator().manual_seed(100 + world.rank)  # and its own batches
    parts = {"model": model, "optimizer": optimizer, "data": GeneratorPart(data, per_rank=True), "rng": GlobalRng()}
    folder.mkdir(parents=True, exist_ok=True)
    if how.endswith(("store", "tiers")):
        local = folder / ("local" if how == "shared-tiers" else f"local-{world.rank}")
        tiers = {"local": local, "durable_every": 2} if how.endswith("tiers") else {}
        options = {"keep": 2, "world": world, "sharded": how == "sharded-store"} | tiers
        store = CheckpointStore(folder / "checkpoints", **options)
        start = store.load(parts) or 0
        steps(model, optimizer, data, range(start + 1, until + 1), world, lambda step: store.save(step, parts))
        if how == "tiers":  # each run ends as a lost node's would, without the close that copies its last step
            store.wait()
            store.release()
        else:
            store.close()
        return finish(folder, model, data, world)
    resume = folder / ("resume.dcp" if how == "sharded" else "resume.pth")
    start = 0
    if resume.exists():
        start = open_resume(resume).restore(parts) if how == "sharded" else load_resume(resume, parts)
    steps(model, optimizer, data, range(start + 1, until + 1), world, lambda step: None)
    save_resume(resume, parts, until, sharded=how == "sharded", world=world)
    finish(folder, model, data, world)


def steps(model, optimizer, data, numbers, world: World, after) -> None:
    for step in numbers:
        inputs = torch.randn(4, 8, generator=data)
        scale = torch.rand(1)  # drawn from the global RNG
        loss = (model(inputs).squeeze(1) - inputs.sum(1) * scale).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= world.size
        optimizer.step()
        after(step)


def finish(folder: Path, model, data, world: World) -> None:
    ending = {"model": model.state_dict(), "data": data.get_state(), "rng": torch.get_rng_state()}
    torch.save(ending, folder / f"end-{world.rank}.pt")


dist.init_process_group("gloo")
for job in sys.argv[1:]:
    folder, until, how = job.split(":")
    train(Path(folder), int(until), how, World.from_env())
dist.barrier()  # the ranks meet before the gloo group goes: none tears it down under another's last work
dist.destroy_process_group()
