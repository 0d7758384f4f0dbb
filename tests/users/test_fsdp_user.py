"""A user's FSDP2 model (fully_shard, one gloo process: its parameters are DTensors) and the saves: a
CheckpointStore and a one-file `save_resume` refuse it in one line that names the sharded save, before
any collective and before anything is written; `save_resume(..., sharded=True)` and a sharded store
write it, and `open_resume(folder).restore(parts)` or the store's `load`, in a new process and with no
`destination=`, resume it bit for bit.
Established by hand first, on 2 ranks too: without the refusal, a store under torchrun wrote a file
that a plain `torch.load(weights_only=True)` refuses, holding rank 0's shards only; and the sharded
folder, read whole, could not be loaded into the sharded model ("mixed torch.Tensor and DTensor")."""

from __future__ import annotations

from helpers import run_python

SAVES = ("store", "file", "sharded", "sharded-store")

PROGRAM = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from exactresume import CheckpointError, CheckpointStore, UserError, open_resume, save_resume

folder, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{mode}", rank=0, world_size=1)
torch.manual_seed(0 if mode == "straight" else 1)  # the resumed model starts elsewhere
width = 32 if mode == "wider" else 16
model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 2))
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
parts = {"model": model, "optimizer": optimizer}


def train(steps):
    for step in steps:
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()


def whole():
    moments = [state["exp_avg_sq"].full_tensor() for state in optimizer.state_dict()["state"].values()]
    return [tensor.full_tensor() for tensor in model.state_dict().values()] + moments


if mode == "straight":
    train(range(1, 4))
    saves = {
        "store": lambda: CheckpointStore(folder / "checkpoints").save(3, {"model": model}),
        "file": lambda: save_resume(folder / "resume.pth", {"optimizer": optimizer}, 3),
        "sharded": lambda: save_resume(folder / "resume.dcp", parts, 3, sharded=True),
        "sharded-store": lambda: CheckpointStore(folder / "sharded", sharded=True).save(3, parts),
    }
    for name, save in saves.items():
        try:
            print(name, "saved", save())
        except UserError as error:
            print(name, "refused:", error)
    train(range(4, 7))
    torch.save(whole(), folder / "straight.pt")
elif mode == "resumed":
    train(range(open_resume(folder / "resume.dcp").restore(parts) + 1, 7))
elif mode == "wider":
    try:
        CheckpointStore(folder / "sharded", sharded=True).load(parts)
    except CheckpointError as error:
        print("wider refused:", error)
else:
    with CheckpointStore(folder / "sharded", sharded=True) as store:
        train(range(store.load(parts) + 1, 7))
if mode in ("resumed", "store-resumed"):
    straight = torch.load(folder / "straight.pt", weights_only=True)
    print(mode, "equal", all(torch.equal(a, b) for a, b in zip(whole(), straight, strict=True)))
dist.destroy_process_group()
"""


def test_a_sharded_model_is_refused_by_the_one_file_saves_and_resumed_by_the_sharded_one(tmp_path):
    program = tmp_path / "fsdp_loop.py"
    program.write_text(PROGRAM)
    straight = run_python(program, tmp_path, "straight")
    assert straight.returncode == 0, straight.stdout
    said = dict(line.split(" ", 1) for line in straight.stdout.splitlines() if line.split(" ")[0] in SAVES)
    assert said["store"].startswith("refused: the part model is sharded over the ranks (0.weight is a DTensor")
    assert said["file"].startswith("refused: the part optimizer is sharded over the ranks")
    assert "save it with CheckpointStore(folder, sharded=True, world=World.from_env())" in said["store"]
    assert "save it with save_resume(folder, parts, step, sharded=True)" in said["file"]
    assert said["sharded"] == f"saved {tmp_path / 'resume.dcp'}"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "resume.pth").exists()
    assert said["sharded-store"] == f"saved {tmp_path / 'sharded' / 'step-00000003.dcp'}"
    for mode in ("resumed", "store-resumed"):
        resumed = run_python(program, tmp_path, mode)
        assert resumed.returncode == 0 and f"{mode} equal True" in resumed.stdout, resumed.stdout
    wider = run_python(program, tmp_path, "wider")
    refused = "wider refused: the part model does not fit " + str(tmp_path / "sharded" / "step-00000003.dcp")
    assert refused + ": model.0.weight: saved [16, 8], given [32, 8]" in wider.stdout, wider.stdout
