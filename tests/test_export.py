"""`exactresume export`: inference weights only, ties kept, fp16 overflow refused, logits close."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open

from exactresume.store.weights import read_weights, save_weights
from exactresume.training.inference import load_model
from helpers import SMALL, assert_one_line_error, call_cli


@pytest.fixture(scope="module")
def resume_file(tmp_path_factory, kjv_folder):
    folder = tmp_path_factory.mktemp("export")
    assert call_cli("train", "--out", folder, "--data", kjv_folder, *SMALL, "--stop-at", 5, "--quiet").returncode == 0
    return folder / "resume.pth"


def logits(model, kjv_folder) -> torch.Tensor:
    tokens = torch.from_numpy(np.load(kjv_folder / "val.npy")[:128].astype(np.int64))[None, :]
    with torch.no_grad():
        return model(tokens)


def test_fp16_safetensors_round_trip(tmp_path, resume_file, kjv_folder):
    out = tmp_path / "model.safetensors"
    finished = call_cli(
        "export", resume_file, "--dtype", "fp16", "--format", "safetensors", "-o", out, "--data", kjv_folder
    )
    assert finished.returncode == 0, finished.stderr
    with safe_open(out, "pt") as file:
        keys, metadata = set(file.keys()), file.metadata()
    source = torch.load(resume_file, weights_only=True)
    assert keys == set(source["model"]) - {"lm_head.weight"}  # the tied matrix is stored once
    assert json.loads(metadata["tied"]) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "optimizer" not in metadata and json.loads(metadata["config"])["hidden_size"] == 32

    exported, reference = load_model(out), load_model(resume_file)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    for name, value in reference.state_dict().items():  # every weight is the fp32 value rounded to fp16
        assert torch.equal(exported.state_dict()[name], value.half().float()), name
    difference = (logits(exported, kjv_folder) - logits(reference, kjv_folder)).abs().max().item()
    assert 0 < difference < 0.05
    printed = re.search(r"max \|logit difference\| (\S+) on the first 128 tokens", finished.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(difference, rel=1e-3)
    ratio = re.search(r"size: (\S+)x the source file", finished.stdout).group(1)
    assert ratio == f"{out.stat().st_size / resume_file.stat().st_size:.3f}"


def test_pt_export_keeps_both_names_on_one_storage(tmp_path, resume_file):
    out = tmp_path / "model_bf16.pt"
    assert call_cli("export", resume_file, "--dtype", "bf16", "-o", out, "--data", tmp_path / "no-data").returncode == 0
    state = torch.load(out, weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert set(state) == set(torch.load(resume_file, weights_only=True)["model"])


def test_missing_data_folder_skips_the_logit_check_with_a_note(tmp_path, resume_file):
    finished = call_cli("export", resume_file, "-o", tmp_path / "m.pt", "--data", tmp_path / "no-data")
    assert finished.returncode == 0 and "logit check skipped" in finished.stdout


def test_read_weights_of_an_export_matches_the_pt_export(tmp_path, resume_file):
    for name in ("a.safetensors", "b.pt"):
        assert call_cli("export", resume_file, "-o", tmp_path / name, "--data", tmp_path).returncode == 0
    assert call_cli("diff", tmp_path / "a.safetensors", tmp_path / "b.pt").returncode == 0


@pytest.fixture
def too_large(tmp_path, resume_file):
    """A weights file with one value beyond fp16's range."""
    state, _ = read_weights(resume_file)
    state = {name: tensor.clone() for name, tensor in state.items()}
    state["model.norm.weight"][3] = -70000.0
    save_weights(tmp_path / "large.pth", state)
    return tmp_path / "large.pth"


def test_fp16_overflow_is_refused(tmp_path, too_large):
    finished = call_cli("export", too_large, "--dtype", "fp16", "-o", tmp_path / "out.safetensors")
    assert_one_line_error(finished, "65504", "model.norm.weight", "--clamp")
    assert not (tmp_path / "out.safetensors").exists()


def test_clamp_saturates_and_bf16_needs_no_clamp(tmp_path, too_large):
    finished = call_cli("export", too_large, "--clamp", "-o", tmp_path / "out.safetensors", "--data", tmp_path)
    assert finished.returncode == 0 and "clamped 1 values" in finished.stdout
    assert read_weights(tmp_path / "out.safetensors")[0]["model.norm.weight"][3].item() == -65504.0
    assert (
        call_cli("export", too_large, "--dtype", "bf16", "-o", tmp_path / "out.pt", "--data", tmp_path).returncode == 0
    )


def test_export_refuses_to_overwrite_its_source(resume_file):
    before = resume_file.read_bytes()
    assert_one_line_error(call_cli("export", resume_file, "-o", resume_file), "overwrite")
    assert resume_file.read_bytes() == before


def test_out_replaces_only_an_earlier_export_and_only_when_told(tmp_path, resume_file, kjv_folder):
    """A typo'd -o (the corpus's train.npy, a log, a checkpoint, a folder) loses nothing: one line each, every
    file as it was; an earlier export is replaced with --overwrite alone."""
    taken = tmp_path / "log.csv"
    taken.write_text("step,train_loss\n1,2.5\n")
    checkpoint = tmp_path / "checkpoints" / "step-00000004.pth"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(resume_file.read_bytes())
    corpus = {path.name: path.read_bytes() for path in kjv_folder.iterdir()}
    for out, told, said in (
        (taken, [], f"-o {taken} exists: give another path, or --overwrite to replace it"),
        (taken, ["--overwrite"], f"-o {taken} is not a pt file (it begins b'step,tra"),
        (tmp_path, ["--overwrite"], f"-o {tmp_path} is a folder: give the file to write"),
        (checkpoint, ["--overwrite"], f"-o {checkpoint} is named as a store names its checkpoints"),
        (kjv_folder / "train.npy", ["--overwrite"], f"is in the --data folder {kjv_folder}"),
        (kjv_folder / "new.pt", [], f"is in the --data folder {kjv_folder}"),
    ):
        assert_one_line_error(call_cli("export", resume_file, "-o", out, "--data", kjv_folder, *told), said)
    assert taken.read_text() == "step,train_loss\n1,2.5\n" and checkpoint.read_bytes() == resume_file.read_bytes()
    assert {path.name: path.read_bytes() for path in kjv_folder.iterdir()} == corpus
    export = tmp_path / "m.pt"
    assert call_cli("export", resume_file, "-o", export, "--data", tmp_path).returncode == 0
    assert call_cli("export", resume_file, "-o", export, "--data", tmp_path, "--dtype", "bf16").returncode == 2
    assert call_cli("export", resume_file, "-o", export, "--data", tmp_path, "--overwrite").returncode == 0
