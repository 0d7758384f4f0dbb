"""`train --divergence`: the twin is the uninterrupted run, and it leaves the run it watches unchanged.

Dropout is switched on here so that both claims depend on each run drawing from its own RNG state.
In-process on purpose: the claim is about two runs sharing one process, not about a new process.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactresume.config import PRESETS, TrainConfig
from exactresume.core.compare import weight_distance
from exactresume.core.steplog import read_divergence, read_loss_log
from exactresume.progress import Progress
from exactresume.store.weights import read_weights
from exactresume.training.job import TrainJob
from exactresume.training.job_run import JobRun
from exactresume.world import World
from helpers import assert_one_line_error, call_cli


@pytest.fixture
def with_dropout(monkeypatch):
    monkeypatch.setitem(PRESETS, "default", replace(PRESETS["default"], dropout=0.2))
    return TrainConfig(steps=6, batch=2, seq_len=16)


def noopt_job(config, kjv_folder, folder, name):
    return TrainJob(
        config,
        kjv_folder,
        folder,
        resume=folder / "resume.pth",
        skip_parts=frozenset({"optimizer"}),
        weights=folder / f"{name}.pth",
        log=folder / f"{name}.csv",
    )


def run(job: TrainJob):
    return JobRun(job, World(), Progress(job.until, "train", "none")).run()


def test_twin_follows_the_uninterrupted_run_and_leaves_the_ablated_run_alone(tmp_path, kjv_folder, with_dropout):
    config = with_dropout
    straight = run(
        TrainJob(config, kjv_folder, tmp_path, weights=tmp_path / "straight.pth", log=tmp_path / "straight.csv")
    )
    run(TrainJob(config, kjv_folder, tmp_path, stop_at=2, log=tmp_path / "stopped.csv"))
    run(noopt_job(config, kjv_folder, tmp_path, "noopt_alone"))
    watched = replace(noopt_job(config, kjv_folder, tmp_path, "noopt"), divergence=tmp_path / "divergence.csv")
    job_run = JobRun(watched, World(), Progress(watched.until, "train", "none"))
    job_run.run()

    rows = read_divergence(tmp_path / "divergence.csv")
    straight_log = read_loss_log(tmp_path / "straight.csv")
    assert [row["reference_loss"] for row in rows] == [straight_log[step] for step in (3, 4, 5, 6)]
    twin = job_run.divergence.reference.model.state_dict()
    assert all(torch.equal(twin[name], value) for name, value in straight.run.model.state_dict().items())
    alone, watched = read_weights(tmp_path / "noopt_alone.pth")[0], read_weights(tmp_path / "noopt.pth")[0]
    assert all(torch.equal(alone[name], watched[name]) for name in alone)
    final = weight_distance(watched, read_weights(tmp_path / "straight.pth")[0])
    assert (rows[-1]["max_abs_diff"], rows[-1]["rel_l2"]) == (final["max_abs_diff"], final["rel_l2"]) != (0, 0)


def test_divergence_needs_a_resume(tmp_path, kjv_folder):
    finished = call_cli(
        "train", "--out", tmp_path, "--data", kjv_folder, "--steps", 4, "--divergence", tmp_path / "d.csv"
    )
    assert_one_line_error(finished, "--divergence", "--resume")
