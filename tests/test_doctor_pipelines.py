"""`exactresume doctor` on the data pipelines and checkpoints people write beside the frameworks: a
torchtitan-style trainer saving torch.distributed.checkpoint folders of Stateful wrappers, and torchdata's
StatefulDataLoader with and without a generator of its own, and with worker processes.

As in test_doctor_frameworks.py, each verdict is checked against the truth found by hand: a straight run
records every step's batch and its final weights, a copy of its step-4 checkpoint is resumed in a folder
of its own, and the two are compared with torch.equal. Every case runs once per session, side by side.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from exactresume.cli import main
from exactresume.doctor.tracer.hooks import idle_step
from helpers import once_per_session, stable_environ
from test_doctor_frameworks import Case, by_hand, doctor_args

pytest.importorskip("torchdata", reason="the test extra's torchdata (StatefulDataLoader)")

CASES = {
    "torchtitan": Case("torchtitan_checkpoint", "step-4", 4),
    "loader_generator": Case("stateful_loader", "step-4.pt", 4, ("--generator",)),
    "loader_global_rng": Case("stateful_loader", "step-4.pt", 4),
    "loader_workers": Case("stateful_loader", "step-4.pt", 4, ("--sampler", "--workers", "2")),
    "loader_fixed": Case("stateful_loader", "step-4.pt", 4, ("--fixed", "--workers", "2")),
    # nanoGPT writes one ckpt.pt: saved at step 4 only, the copy resumed by hand is step 4's
    "nanogpt": Case("nanogpt_batches", "ckpt.pt", 4, ("--save-every", "4")),
    "nanogpt_rng": Case("nanogpt_batches", "ckpt.pt", 4, ("--save-every", "4", "--save-rng")),
    "reseeded": Case("reseeded_sampler", "step-4.pt", 4),
}


def run_case(root: Path, name: str) -> tuple[str, dict]:
    case, folder = CASES[name], root / name
    with ThreadPoolExecutor(1) as hand:
        truth = hand.submit(by_hand, case, folder / "by_hand")
        code = main(doctor_args(case, folder, warm=True))
        doctor = folder / "doctor"
        facts = json.loads((doctor / "doctor.json").read_text())
        said = (doctor / "verdict.txt").read_text() + (doctor / "report.md").read_text()
        return name, {"code": code, "said": said, "facts": facts, "truth": truth.result()["0"]}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict:
    """Every case through the doctor and by hand, once: name -> code, what it said, doctor.json, truth."""

    def every_case(root: Path) -> dict:
        with ThreadPoolExecutor(3) as pool:
            return dict(pool.map(lambda name: run_case(root, name), CASES))

    with stable_environ():
        return once_per_session(tmp_path_factory, "pipelines", every_case)


def diagnosis(pipelines, name: str) -> dict:
    return pipelines[name]["facts"]["diagnosis"]


def test_a_torchtitan_checkpoint_names_the_scheduler_it_lacks(pipelines):
    truth = pipelines["torchtitan"]["truth"]
    assert truth["same_batch"] == [True] * 4 and not truth["weights_equal"]  # by hand: the warmup restarts
    found = diagnosis(pipelines, "torchtitan")
    assert found["cause"] == "scheduler_lost" and found["first_step"] == 6, found["headline"]
    assert "LambdaLR" in found["headline"]
    assert [row["kind"] for row in found["missing"]] == ["lr_scheduler"]  # the model and AdamW are in the folder
    files = pipelines["torchtitan"]["facts"]["files"]
    assert {f["read"] for f in files} == {".metadata"} and "optimizer.state.0.weight.exp_avg" in files[0]["keys"]


def test_the_optimizer_state_dcp_initialises_is_not_a_step(pipelines):
    resumed = pipelines["torchtitan"]["facts"]["runs"]["resumed"]["steps"]
    assert len(resumed) == 4 and all(step["lr"] != [0.0] for step in resumed)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    assert idle_step(optimizer, (optimizer,), {})  # no gradients at all
    model.weight.grad, model.bias.grad = torch.zeros(1, 2), torch.zeros(1)
    assert idle_step(optimizer, (optimizer,), {"closure": None})  # DCP's: zero gradients, no closure
    assert not idle_step(optimizer, (optimizer,), {}, ["a forward's inputs"])  # a step after a forward
    model.bias.grad[0] = 1.0
    assert not idle_step(optimizer, (optimizer,), {})
    assert not idle_step(optimizer, (optimizer, lambda: 0.0), {})  # a closure runs its own forward


def test_a_stateful_loader_sharing_its_generator_falls_behind_next_epoch(pipelines):
    truth = pipelines["loader_generator"]["truth"]
    assert truth["same_batch"] == [True, True, False, False] and not truth["weights_equal"]  # by hand
    found = diagnosis(pipelines, "loader_generator")
    assert found["cause"] == "generator_behind" and found["first_step"] == 7, found["headline"]
    assert "one draw behind" in found["headline"] and "StatefulDataLoader" in found["headline"]
    assert any("differs from step 5, the batches still equal" in line for line in found["evidence"])
    assert any("sampler=torchdata.stateful_dataloader.sampler.RandomSampler" in fix for fix in found["fixes"])


def test_the_fix_named_resumes_exactly_with_workers(pipelines):
    truth = pipelines["loader_fixed"]["truth"]
    assert truth["same_batch"] == [True] * 4 and truth["weights_equal"]  # by hand
    assert pipelines["loader_fixed"]["code"] == 0, pipelines["loader_fixed"]["said"]
    assert diagnosis(pipelines, "loader_fixed")["missing"] == []


def test_a_stateful_loader_without_generator_draws_from_the_restored_rng(pipelines):
    truth = pipelines["loader_global_rng"]["truth"]
    assert truth["same_batch"] == [True] * 4 and not truth["weights_equal"]  # by hand: other dropout masks
    found = diagnosis(pipelines, "loader_global_rng")
    assert found["cause"] == "rng_after_iterator", found["headline"]
    assert "dropout" in found["headline"] and "not saved" not in found["headline"]


def test_a_plain_sampler_with_workers_is_named_not_set_epoch(pipelines):
    truth = pipelines["loader_workers"]["truth"]
    assert truth["drew_step"] == [None] * 4 and not truth["weights_equal"]  # by hand: reshuffled
    found = diagnosis(pipelines, "loader_workers")
    assert found["cause"] == "data_position_lost" and found["first_step"] == 5, found["headline"]
    assert "not in StatefulDataLoader's state_dict()" in found["headline"] and "set_epoch" not in found["headline"]
    assert "/pymp-" not in pipelines["loader_workers"]["said"]  # multiprocessing's temp folders are not the script's
    moves = pipelines["loader_workers"]["facts"]["files"]
    assert all("/pymp-" not in f["path"] for f in moves)


def test_batches_drawn_from_the_global_rng_are_named_as_that_rng(pipelines):
    truth = pipelines["nanogpt"]["truth"]
    assert truth["drew_step"][0] == 1 and not truth["weights_equal"]  # by hand: step 1's batch again
    found = diagnosis(pipelines, "nanogpt")
    assert found["cause"] == "rng_batches" and found["first_step"] == 5, found["headline"]
    assert "drawn from the global torch RNG" in found["headline"] and "position" not in found["headline"]


def test_the_rng_saved_before_the_prefetch_counts_as_saved(pipelines):
    truth = pipelines["nanogpt_rng"]["truth"]
    assert truth["same_batch"] == [True] * 4 and truth["weights_equal"]  # by hand: exact
    assert pipelines["nanogpt_rng"]["code"] == 0, pipelines["nanogpt_rng"]["said"]
    found = diagnosis(pipelines, "nanogpt_rng")
    assert found["missing"] == [] and not [note for note in found["notes"] if "torch RNG" in note], found["notes"]


def test_a_generator_reseeded_each_epoch_needs_no_saved_state(pipelines):
    truth = pipelines["reseeded"]["truth"]
    assert truth["same_batch"] == [True] * 4 and truth["weights_equal"]  # by hand: exact
    found = diagnosis(pipelines, "reseeded")
    assert pipelines["reseeded"]["code"] == 0 and found["missing"] == [], found["headline"]
    assert not [note for note in found["notes"] if "generator" in note], found["notes"]
    # the DataLoader drew its base seed from the global RNG one epoch fewer: named, not blamed
    assert any(note.startswith("the torch RNG differs from step 5") for note in found["notes"]), found["notes"]
