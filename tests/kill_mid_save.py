"""Run by test_distributed under torchrun (2 processes): save a sharded checkpoint, then kill rank 1
in the middle of writing its shard of the next one.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/kill_mid_save.py DATA FOLDER

Leaves FOLDER/resume.dcp (step 2), FOLDER/step2.pth (the same state as one sealed file) and the
killed save's FOLDER/resume.dcp.tmp/.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.parallel.replicas import process_group
from exactresume.parallel.replicate import replicate
from exactresume.store.access import save_resume
from exactresume.training.loop import build_run, train
from exactresume.world import World


def write_part_then_die(writer: FileSystemWriter, plan, planner) -> None:
    """Stand-in for rank 1's shard write: a few bytes of its file, then SIGKILL (no cleanup runs)."""
    (Path(writer.path) / "__1_0.distcp").write_bytes(b"the first bytes of a shard")
    os.kill(os.getpid(), signal.SIGKILL)


def main(data: Path, folder: Path) -> None:
    with process_group(World.from_env()) as world:
        run = build_run(TrainConfig(steps=8, batch=2, seq_len=16, preset="tiny"), load_tokens(data))
        replicate(run, world)
        train(run, 2)
        save(folder / "resume.dcp", run, world, sharded=True)
        save(folder / "step2.pth", run, world, sharded=False)
        train(run, 3)
        if world.rank == 1:
            FileSystemWriter.write_data = write_part_then_die
        save(folder / "resume.dcp", run, world, sharded=True)


def save(path: Path, run, world: World, sharded: bool) -> None:
    """Every rank saves: a DCP folder of every rank's shard, or one file written by rank 0."""
    save_resume(path, run.parts(), run.step.value, sharded=sharded, world=world)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
