"""A user's loop under torchrun (programs/ranks_loop.py, 2 ranks) saving through one CheckpointStore
given the run's world (plain, and sharded), through `save_resume(..., world=)` and through a sharded
`save_resume`, every rank calling them. Stopped at step 3 and resumed by a new torchrun, each ends where a straight run
ends, bit for bit, on every rank: weights, each rank's batch generator and each rank's global RNG.
Established by hand first: the checkpoint keeps both ranks' generator states (read back with a plain
torch.load), and the ranks' streams differ, so a resume that gave rank 1 rank 0's would part (a
sharded resume once did). Without `world=`, a rank's store is refused in one line that says what to
give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactresume import CheckpointStore, UserError
from helpers import FORKED_TORCHRUN, run_python

PROGRAM = Path(__file__).parent / "programs" / "ranks_loop.py"
TORCHRUN = (FORKED_TORCHRUN, "2")


HOWS = ("store", "sharded-store", "file", "sharded", "tiers", "shared-tiers")


def torchrun(*runs: tuple[Path, int, str]) -> str:
    """One torchrun of PROGRAM, its runs one after another; what it printed."""
    finished = run_python(*TORCHRUN, PROGRAM, *(f"{folder}:{until}:{how}" for folder, until, how in runs))
    assert finished.returncode == 0, finished.stdout
    return finished.stdout


def ending(folder: Path, rank: int) -> dict:
    return torch.load(folder / f"end-{rank}.pt", weights_only=True)


def test_every_rank_saving_through_each_way_resumes_bit_for_bit(tmp_path):
    straight = tmp_path / "straight"
    torchrun((straight, 6, "store"), *((tmp_path / how, 3, how) for how in HOWS))
    assert not torch.equal(ending(straight, 0)["data"], ending(straight, 1)["data"])  # each rank its own stream
    resumed = torchrun(*((tmp_path / how, 6, how) for how in HOWS))
    # rank 0's own local tier holds step 3, rank 1's none: both take the durable tier's step 2 (once)
    assert resumed.count("the ranks' local tiers hold different steps ([3, 2])") == 1, resumed
    for how in HOWS:
        for rank in (0, 1):
            expected, got = ending(straight, rank), ending(tmp_path / how, rank)
            for name, tensor in expected["model"].items():
                assert torch.equal(got["model"][name], tensor), (how, rank, name)
            assert torch.equal(got["data"], expected["data"]), (how, rank)
            assert torch.equal(got["rng"], expected["rng"]), (how, rank)
    for how, file in (("store", "checkpoints/step-00000006.pth"), ("file", "resume.pth")):
        saved = torch.load(tmp_path / how / file, weights_only=True)
        for rank, state in enumerate(saved["data"]["per_rank"]):
            assert torch.equal(state, ending(straight, rank)["data"]), (how, rank)
    assert sorted(path.name for path in (tmp_path / "tiers" / "checkpoints").iterdir()) == [
        "step-00000004.pth",
        "step-00000006.pth",
    ]
    for how, suffix in (("store", "pth"), ("sharded-store", "dcp")):
        kept = sorted(path.name for path in (tmp_path / how / "checkpoints").iterdir())
        assert kept == [f"step-00000005.{suffix}", f"step-00000006.{suffix}"], how


def test_a_ranks_store_without_world_is_refused_naming_the_option(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in rank 1
    model = torch.nn.Linear(2, 2)
    with CheckpointStore(tmp_path) as rank_0:
        rank_0.save(1, {"model": model})
        with pytest.raises(UserError, match=r"is being written by .*; under torchrun, give every rank's store world="):
            CheckpointStore(tmp_path).save(2, {"model": model})
