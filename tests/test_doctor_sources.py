"""`exactresume doctor` names each source of randomness by itself, and says "the data position" only where
the resumed steps read other samples: augmentation noise from numpy's global RNG or from a numpy Generator
the script keeps (the samples right, the noise not), an order drawn from a random.Random a sampler keeps or
from Python's global random, a loop that resumes at the saved step, and sources the resume rebuilds (a
generator reseeded from the epoch; numpy seeded in each worker) never called missing; noise drawn in
workers seeded anew, which the doctor cannot see, said as such; torch's RNG saved but set back late.

Each verdict is checked against the truth found by hand, outside the doctor: a straight run records every
step's batch (and, for the numpy cases, the samples before the noise) and its final weights, a copy of its
step-4 checkpoint is resumed in a folder of its own, and the two are compared with torch.equal. Every case
runs with the flag that fixes it too: exact by hand, and exact to the doctor.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from exactresume.cli import main
from helpers import once_per_session, stable_environ
from test_doctor_frameworks import Case, by_hand, doctor_args


def case(script: str, *flags: str) -> Case:
    return Case(script, "resume.pt.4", 4, flags, copied_as="resume.pt")


CASES = {
    "numpy_global": case("numpy_augment", "--source", "global"),
    "numpy_in_order": case("numpy_augment", "--source", "global", "--no-shuffle"),
    "numpy_generator": case("numpy_augment", "--source", "generator"),
    "numpy_workers": case("numpy_augment", "--source", "workers"),  # exact: seeded in each worker
    "sampler_random": case("own_sampler", "--source", "sampler"),
    "shuffled_files": case("own_sampler", "--source", "files"),
    "off_by_one": case("off_by_one"),
    "numpy_workers_rebuilt": case("numpy_augment", "--source", "workers", "--rebuild"),
    "reseeded_scaler": Case("reseeded_sampler", "step-4.pt", 4, ("--scaler",)),
    "rng_set_late": Case("reseeded_sampler", "step-4.pt", 4, ("--dropout-rng", "--batch", "6")),
}
FIXED = ("numpy_global", "numpy_generator", "sampler_random", "shuffled_files", "off_by_one")
CASES |= {f"{name}_fixed": replace(CASES[name], extra=(*CASES[name].extra, "--fixed")) for name in FIXED}


def samples_equal(folder: Path, k: int) -> list[bool]:
    """Whether each resumed step read the straight run's samples (before any noise), by hand."""
    a, b = torch.load(folder / "a"), torch.load(folder / "b")
    return [torch.equal(x, y) for x, y in zip(a["raw"][k:], b["raw"], strict=True)]


def run_case(root: Path, name: str) -> tuple[str, dict]:
    found, folder = CASES[name], root / name
    with ThreadPoolExecutor(1) as hand:
        truth = hand.submit(by_hand, found, folder / "by_hand")
        code = main(doctor_args(found, folder, warm=True))
        facts = json.loads((folder / "doctor" / "doctor.json").read_text())
        result = {"code": code, "diagnosis": facts["diagnosis"], "truth": truth.result()["0"]}
    if found.script == "numpy_augment":
        result["samples_equal"] = samples_equal(folder / "by_hand", found.resume_step)
    return name, result


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Every case through the doctor and by hand, once: name -> code, diagnosis, truth."""

    def every_case(root: Path) -> dict:
        with ThreadPoolExecutor(3) as pool:
            return dict(pool.map(lambda name: run_case(root, name), CASES))

    with stable_environ():
        return once_per_session(tmp_path_factory, "sources", every_case)


def exact_by_hand(found: dict) -> bool:
    truth = found["truth"]
    return truth["same_batch"] == [True] * 4 and truth["weights_equal"]


@pytest.mark.parametrize("name", [f"{name}_fixed" for name in FIXED] + ["numpy_workers"])
def test_the_fixed_scripts_are_exact_by_hand_and_to_the_doctor(sources, name):
    found = sources[name]
    assert exact_by_hand(found), found["truth"]
    assert found["code"] == 0 and found["diagnosis"]["cause"] == "exact", found["diagnosis"]["headline"]
    assert found["diagnosis"]["missing"] == []


@pytest.mark.parametrize(
    ("name", "source", "fix"),
    [
        ("numpy_global", "numpy's global RNG", "save np.random.get_state() with the checkpoint"),
        ("numpy_in_order", "numpy's global RNG", "np.random.set_state(saved) on resume"),
        ("numpy_generator", "the numpy Generator augment.rng", "augment.rng.bit_generator.state = saved"),
    ],
)
def test_augmentation_noise_is_named_not_the_data_position(sources, name, source, fix):
    found = sources[name]
    assert found["samples_equal"] == [True] * 4 and not exact_by_hand(found)  # by hand: the samples, not the noise
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "augmentation_rng_lost" and diagnosis["first_step"] == 5, diagnosis["headline"]
    assert f"drawn from {source}, whose state the resume did not restore" in diagnosis["headline"]
    assert "position" not in diagnosis["headline"] and not any("first batch" in e for e in diagnosis["evidence"])
    assert [(row["kind"], row["name"]) for row in diagnosis["missing"]] == [("random_source", source)]
    assert fix in diagnosis["missing"][0]["fix"]


@pytest.mark.parametrize(
    ("name", "source", "fix"),
    [
        ("sampler_random", "drawn from the random.Random sampler.rng", "save sampler.rng.getstate()"),
        ("shuffled_files", "the order is drawn from Python's global random", "save random.getstate()"),
    ],
)
def test_an_order_drawn_from_python_random_names_that_source(sources, name, source, fix):
    found = sources[name]
    assert found["truth"]["same_batch"] == [False] * 4  # by hand: another order
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "data_position_lost" and diagnosis["first_step"] == 5, diagnosis["headline"]
    assert f"{source}, which the resume did not restore" in diagnosis["headline"]
    assert [row["kind"] for row in diagnosis["missing"]] == ["random_source"]
    assert fix in diagnosis["missing"][0]["fix"] and "get_state()" not in diagnosis["missing"][0]["fix"]


def test_a_loop_that_resumes_at_the_saved_step_is_named_as_such(sources):
    found = sources["off_by_one"]
    assert found["truth"]["drew_step"][0] == 4  # by hand: the resumed run's first batch is step 4's again
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "resumed_at_saved_step" and diagnosis["first_step"] == 5, diagnosis["headline"]
    assert "trains step 4's batch again: it starts at the saved step, not the one after" in diagnosis["headline"]
    assert "the resumed step 5 drew the batch of step 4" in " ".join(diagnosis["evidence"])
    assert len(diagnosis["fixes"]) == 1 and "resumed loop" in diagnosis["fixes"][0]
    assert "DataLoader" not in diagnosis["fixes"][0] and "sampler" not in diagnosis["fixes"][0]


def test_a_generator_rebuilt_from_the_epoch_is_never_missing(sources):
    """Reseeded from the seed and the epoch, it is restored though no file holds it: the verdict names the
    GradScaler that was lost (its scale restarts; on the CPU in float32 the weights do not show it within
    the steps compared), and only it."""
    found = sources["reseeded_scaler"]
    assert found["truth"]["same_batch"] == [True] * 4  # by hand: the order is the straight run's
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "scaler_lost", diagnosis["headline"]
    assert [row["kind"] for row in diagnosis["missing"]] == ["grad_scaler"]
    assert not any("generator" in note.lower() for note in diagnosis["notes"])


def test_seeded_worker_augmentation_is_exact_and_names_nothing(sources):
    diagnosis = sources["numpy_workers"]["diagnosis"]
    assert diagnosis["missing"] == [] and not any("numpy" in note for note in diagnosis["notes"])


def test_augmentation_drawn_in_workers_seeded_anew_is_said_unseen(sources):
    """The resume reads the batches left through a new loader, whose workers are seeded anew: the same samples,
    other noise; torch's RNG, set back by the script and moved by that loader, is not blamed."""
    found = sources["numpy_workers_rebuilt"]
    assert found["samples_equal"] == [True] * 4 and not found["truth"]["same_batch"][0]  # by hand
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "augmentation_unseen" and diagnosis["first_step"] == 5, diagnosis["headline"]
    assert "in the DataLoader's workers" in diagnosis["headline"] and "torch" not in diagnosis["headline"]
    assert any("seeded by the epoch and the sample's index" in fix for fix in diagnosis["fixes"])


def test_an_rng_saved_but_set_back_late_is_not_called_unsaved(sources):
    found = sources["rng_set_late"]
    assert found["truth"]["same_batch"] == [True] * 4 and not found["truth"]["weights_equal"]  # by hand: masks
    diagnosis = found["diagnosis"]
    assert diagnosis["cause"] == "rng_misplaced" and diagnosis["first_step"] == 5, diagnosis["headline"]
    assert "was saved and set back" in diagnosis["headline"] and "not saved" not in diagnosis["headline"]
    assert diagnosis["missing"] == [] and any("generator=" in fix for fix in diagnosis["fixes"])
