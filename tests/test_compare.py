"""Bit-for-bit comparison: `exactresume diff`, compare.py and the lab's compare.json.

Identical means the same bits: a NaN is equal only to a NaN with the same payload, -0.0 differs
from +0.0, and no NaN or Inf is ever dropped from the verdict (Python's max drops a NaN that does
not come first, which once made `diff` call two different files equal).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from exactresume.config import ModelConfig, TrainConfig
from exactresume.core.compare import identical, largest, tensor_diff, weight_distance
from exactresume.core.model import MiniMindLM
from exactresume.lab.lab import LabConfig, comparison_figures
from exactresume.store.weights import read_weights, save_weights
from helpers import assert_one_line_error, call_cli, run_cli

NAN, INF = float("nan"), float("inf")
DOCS_LAB = Path(__file__).resolve().parents[1] / "docs" / "lab"


def with_bits(value: float, flip: int) -> torch.Tensor:
    """A float32 scalar tensor holding `value` with the integer `flip` xor-ed into its bits."""
    tensor = torch.tensor([value], dtype=torch.float32)
    tensor.view(torch.int32)[0] ^= flip
    return tensor


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """A weights file of the default model (freshly initialised, seeded), as a lab's straight.pth."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "straight.pth"
    save_weights(path, MiniMindLM(ModelConfig()).state_dict())
    return path


def edited_copy(straight: Path, folder: Path, edit) -> Path:
    state = {name: tensor.clone() for name, tensor in read_weights(straight)[0].items()}
    edit(state)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "edited.pth"
    save_weights(path, state)
    return path


def set_value(name: str, index: int, value) -> callable:
    def edit(state):
        state[name].view(-1)[index] = value

    return edit


# -- compare.py ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, note",
    [
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, NAN]), "NaN 0 in A, 1 in B"),
        (torch.tensor([NAN, 2.0]), torch.tensor([1.0, 2.0]), "NaN 1 in A, 0 in B"),  # NaN first, too
        (torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]), "1 zero of the other sign"),
        (with_bits(NAN, 0), with_bits(NAN, 1), "1 NaN with another payload"),
        (torch.tensor([1.0, INF]), torch.tensor([1.0, 3.0]), "Inf 1 in A, 0 in B"),
        (torch.tensor([INF]), torch.tensor([-INF]), "Inf 1 in A, 1 in B"),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64), "dtype float32 against float64"),
    ],
    ids=["nan-late", "nan-first", "signed-zero", "nan-payload", "inf", "inf-sign", "dtype"],
)
def test_differences_in_bits_are_never_equal(a, b, note):
    diff = tensor_diff(a, b)
    assert not diff.identical and not diff.within(0.0)
    assert note in diff.describe()
    if diff.nonfinite_differ:  # a NaN or Inf against anything else: not equal at any tolerance
        assert not diff.within(1e9)


def test_the_same_bits_are_equal_even_when_not_finite():
    a = torch.tensor([1.0, NAN, INF, -INF, -0.0])
    diff = tensor_diff(a, a.clone())
    assert diff.identical and diff.within(0.0) and diff.describe() == "bit-identical"
    assert diff.nan == (1, 1) and diff.inf == (2, 2) and diff.max_abs == 0.0


def test_tolerance_applies_to_finite_values_only():
    a, b = torch.tensor([1.0, 2.0, NAN]), torch.tensor([1.0, 2.5, NAN])
    diff = tensor_diff(a, b)
    assert diff.max_abs == 0.5 and diff.within(0.5) and not diff.within(0.4) and not diff.within(0.0)
    assert tensor_diff(torch.tensor([0.0]), torch.tensor([-0.0])).within(1e-9)  # -0.0 == +0.0 within a tolerance


def test_weight_distance_does_not_drop_a_nan():
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([3.0, 4.0])}
    b = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([3.0, NAN])}
    assert math.isnan(weight_distance(a, b)["max_abs_diff"]) and math.isnan(weight_distance(b, a)["max_abs_diff"])
    assert not identical(a, b) and identical(a, {k: v.clone() for k, v in a.items()})
    inf = {"x": torch.tensor([1.0, INF, 2.0])}
    assert weight_distance(inf, {"x": inf["x"].clone()})["max_abs_diff"] == 0.0  # the same Inf: inf - inf is no NaN
    assert math.isnan(weight_distance(inf, {"x": torch.tensor([1.0, 3.0, 2.5])})["max_abs_diff"])
    plus, minus = {"x": torch.tensor([0.0, 2.0])}, {"x": torch.tensor([-0.0, 2.0])}
    assert weight_distance(minus, plus)["max_abs_diff"] == 0.0 and not identical(minus, plus)


# -- exactresume diff ----------------------------------------------------------------------------------


def test_diff_of_a_copy_with_one_nan_is_different_and_says_nan(tmp_path, straight):
    """The issue's repro: a copy of straight.pth with model.norm.weight[0] = nan."""
    copy = edited_copy(straight, tmp_path, set_value("model.norm.weight", 0, NAN))
    finished = run_cli("diff", straight, copy)
    assert finished.returncode == 1, finished.stdout + finished.stderr
    assert "NaN" in finished.stdout and ": different (atol 0)" in finished.stdout
    assert "model.norm.weight  (1 of " in finished.stdout  # the tensor is named
    assert call_cli("diff", straight, copy, "--atol", "1e9").returncode == 1  # no tolerance forgives a NaN


@pytest.mark.parametrize("atol", ["-1", "nan", "inf"])
def test_a_tolerance_no_difference_can_be_within_is_refused(straight, atol):
    """Equal within -1 would say `equal` of a file to itself, with no difference in range."""
    assert_one_line_error(call_cli("diff", straight, straight, "--atol", atol), f"{atol} is not a tolerance")


@pytest.mark.parametrize(
    "edit, note",
    [
        (set_value("model.norm.weight", 5, -1.0), "2.000e+00  model.norm.weight"),  # 1.0 -> -1.0
        (set_value("model.norm.weight", 5, INF), "Inf 0 in A, 1 in B"),
        (set_value("lm_head.weight", 0, NAN), "NaN 0 in A, 1 in B"),
        (lambda state: state["model.layers.0.mlp.up_proj.weight"].view(-1)[3:4].neg_(), "differ in bits"),
    ],
    ids=["finite", "inf", "nan-in-tied", "sign"],
)
def test_diff_finds_each_kind_of_difference(tmp_path, straight, edit, note):
    finished = call_cli("diff", straight, edited_copy(straight, tmp_path, edit))
    assert finished.returncode == 1 and note in finished.stdout, finished.stdout
    assert finished.stdout.strip().endswith("different (atol 0)")


def test_diff_tells_signed_zeros_and_nan_payloads_apart(tmp_path, straight):
    def signed_zero(state):
        state["model.norm.weight"][0] = 0.0

    def negative_zero(state):
        state["model.norm.weight"][0] = -0.0

    plus, minus = (
        edited_copy(straight, tmp_path / "p", signed_zero),
        edited_copy(straight, tmp_path / "m", negative_zero),
    )
    finished = call_cli("diff", plus, minus)
    assert finished.returncode == 1 and "1 zero of the other sign" in finished.stdout, finished.stdout
    assert call_cli("diff", plus, minus, "--atol", "1e-12").returncode == 0  # numerically equal
    one = edited_copy(straight, tmp_path / "n1", set_value("model.norm.weight", 0, with_bits(NAN, 0)[0]))
    other = edited_copy(straight, tmp_path / "n2", set_value("model.norm.weight", 0, with_bits(NAN, 1)[0]))
    finished = call_cli("diff", one, other)
    assert finished.returncode == 1 and "1 NaN with another payload" in finished.stdout, finished.stdout
    finished = call_cli("diff", one, edited_copy(straight, tmp_path / "n3", set_value("model.norm.weight", 0, NAN)))
    assert finished.returncode == 0 and "NaN 1 in A, 1 in B" in finished.stdout  # the same NaN bits: equal


def test_diff_of_a_file_with_itself_is_equal(tmp_path, straight):
    finished = call_cli("diff", straight, shutil.copy(straight, tmp_path / "copy.pth"))
    assert finished.returncode == 0, finished.stdout
    assert finished.stdout.strip().splitlines() == ["47 tensors, max abs difference 0.000e+00: equal (atol 0)"]


# -- the lab's compare.json ------------------------------------------------------------------------------


def fake_lab(folder: Path, straight: Path, resumed: Path) -> LabConfig:
    """The files comparison_figures reads, for 4 steps stopped at 2: every run's logs equal straight's."""
    details = folder / "details"
    details.mkdir(parents=True)
    shutil.copy(straight, folder / "straight.pth")
    shutil.copy(resumed, folder / "resumed.pth")
    for name in ("noopt", "noskip"):
        shutil.copy(straight, folder / f"{name}.pth")
    losses = {step: f"{9 - step}.000000" for step in range(1, 5)}
    log = lambda steps: "step,train_loss\n" + "".join(f"{s},{losses[s]}\n" for s in steps)  # noqa: E731
    samples = lambda steps: "step,starts\n" + "".join(f"{s},{s} {s + 100}\n" for s in steps)  # noqa: E731
    (folder / "straight_log.csv").write_text(log(range(1, 5)))
    (details / "straight_samples.csv").write_text(samples(range(1, 5)))
    (folder / "resumed_log.csv").write_text(log((3, 4)))
    for name in ("resumed", "noopt", "noskip"):
        (details / f"{name}_samples.csv").write_text(samples((3, 4)))
    for name in ("noopt", "noskip"):
        (details / f"{name}_log.csv").write_text(log((3, 4)))
    return LabConfig(train=TrainConfig(steps=4), stop_at=2, out=folder)


def test_lab_compare_json_does_not_call_a_nan_equal(tmp_path, straight):
    nan_copy = edited_copy(straight, tmp_path, set_value("model.norm.weight", 0, NAN))
    runs = comparison_figures(fake_lab(tmp_path / "lab", straight, nan_copy))["runs"]
    assert math.isnan(runs["resumed"]["max_abs_diff"]) and runs["resumed"]["bits_equal"] is False
    assert runs["noopt"]["max_abs_diff"] == 0 and runs["noopt"]["bits_equal"] is True
    zero_copy = edited_copy(straight, tmp_path / "z", set_value("model.norm.weight", 0, -0.0))
    zero_copy_of_zero = edited_copy(straight, tmp_path / "zz", set_value("model.norm.weight", 0, 0.0))
    runs = comparison_figures(fake_lab(tmp_path / "lab2", zero_copy_of_zero, zero_copy))["runs"]
    assert runs["resumed"]["max_abs_diff"] == 0 and runs["resumed"]["bits_equal"] is False


def test_lab_compare_json_does_not_drop_a_nan_loss(tmp_path, straight):
    config = fake_lab(tmp_path / "lab", straight, straight)
    (tmp_path / "lab" / "resumed_log.csv").write_text("step,train_loss\n3,6.000000\n4,nan\n")  # NaN not first
    resumed = comparison_figures(config)["runs"]["resumed"]
    assert math.isnan(resumed["max_abs_loss_diff"]) and not resumed["log_rows_equal"]
    assert resumed["bits_equal"] is True  # the weights are the same; the loss is not


def test_largest_keeps_a_nan_wherever_it_is():
    assert math.isnan(largest([0.0, NAN, 1.0])) and math.isnan(largest([NAN])) and largest([2.0, 1.0]) == 2.0
    assert largest([]) == 0.0
