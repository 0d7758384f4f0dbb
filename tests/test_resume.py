"""The promise: a run stopped at K and resumed in a new process ends bit-identical to a straight run."""

from __future__ import annotations

import pytest
import torch

from exactresume.core.steplog import read_loss_log, read_samples
from exactresume.store.weights import read_weights
from helpers import SMALL, train_cli


def train(folder, data, *flags):
    return train_cli(folder, "--data", data, *SMALL, *flags, check=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kjv_folder):
    """A straight 8-step run and the same run stopped at step 3, shared by this module's tests."""
    folder = tmp_path_factory.mktemp("runs")
    train(
        folder,
        kjv_folder,
        "--weights",
        folder / "straight.pth",
        "--log",
        folder / "straight.csv",
        "--samples",
        folder / "straight_samples.csv",
    )
    train(folder, kjv_folder, "--stop-at", 3, "--log", folder / "stopped.csv")
    return folder


def test_resume_in_new_process_is_bit_identical(tmp_path, kjv_folder, runs):
    resume = runs / "resume.pth"
    train(
        tmp_path,
        kjv_folder,
        "--resume",
        resume,
        "--weights",
        tmp_path / "resumed.pth",
        "--log",
        tmp_path / "resumed.csv",
    )
    straight, resumed = read_weights(runs / "straight.pth")[0], read_weights(tmp_path / "resumed.pth")[0]
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    straight_log, resumed_log = read_loss_log(runs / "straight.csv"), read_loss_log(tmp_path / "resumed.csv")
    assert sorted(resumed_log) == list(range(4, 9))
    assert all(resumed_log[step] == straight_log[step] for step in resumed_log)
    assert read_loss_log(runs / "stopped.csv") == {s: straight_log[s] for s in range(1, 4)}


@pytest.mark.parametrize("name, flag", [("noopt", "--no-optim"), ("noskip", "--no-skip")])
def test_dropping_a_part_changes_the_result(tmp_path, kjv_folder, runs, name, flag):
    train(
        tmp_path,
        kjv_folder,
        "--resume",
        runs / "resume.pth",
        flag,
        "--weights",
        tmp_path / f"{name}.pth",
        "--samples",
        tmp_path / f"{name}_samples.csv",
    )
    straight, ablated = read_weights(runs / "straight.pth")[0], read_weights(tmp_path / f"{name}.pth")[0]
    worst = max((ablated[k] - straight[k]).abs().max().item() for k in straight)
    assert worst > 1e-4, worst
    straight_samples, samples = (
        read_samples(runs / "straight_samples.csv"),
        read_samples(tmp_path / f"{name}_samples.csv"),
    )
    if name == "noskip":  # the reseeded generator draws batch 1 again at step 4
        assert samples[4] == straight_samples[1] != straight_samples[4]
    else:
        assert samples[4] == straight_samples[4]


def test_resume_file_is_plain_torch_with_every_part(runs):
    state = torch.load(runs / "resume.pth", weights_only=True)
    assert {"model", "optimizer", "step", "gen_state", "rng", "config"} <= state.keys()
    assert state["version"] == 3 and "layout" not in state
    assert state["step"] == 3
    assert state["gen_state"].dtype == torch.uint8
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    assert len(state["optimizer"]["state"]) == len(state["optimizer"]["param_groups"][0]["params"])


def test_resume_can_stop_again_and_still_match(tmp_path, kjv_folder, runs):
    train(tmp_path, kjv_folder, "--resume", runs / "resume.pth", "--stop-at", 6)
    train(tmp_path, kjv_folder, "--resume", tmp_path / "resume.pth", "--weights", tmp_path / "final.pth")
    straight, final = read_weights(runs / "straight.pth")[0], read_weights(tmp_path / "final.pth")[0]
    assert all(torch.equal(straight[k], final[k]) for k in straight)
