"""`exactresume inspect`: kind, version, step, config, parts and sizes, checksum, for each kind of file."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from exactresume.store.resume import OPTIONAL_PARTS, PART_NAMES
from helpers import SMALL, assert_one_line_error, call_cli

FP32_PARTS = set(PART_NAMES) - set(OPTIONAL_PARTS)  # an fp32 run has no loss scaler


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, kjv_folder):
    """A small run stopped at step 3 (resume.pth, and resume.dcp sharded), its end (final.pth), and fp16
    exports of both."""
    folder = tmp_path_factory.mktemp("inspect")
    for flags in (["--stop-at", 3, "--sharded"], ["--stop-at", 3], []):  # each log.csv over the one before
        flags = ["--overwrite", *flags]
        assert call_cli("train", "--out", folder, "--data", kjv_folder, *SMALL, "--quiet", *flags).returncode == 0
    for source, out in (("final.pth", "final_fp16.pt"), ("resume.pth", "resume_fp16.safetensors")):
        assert call_cli("export", folder / source, "-o", folder / out, "--data", kjv_folder).returncode == 0
    return folder


def inspect_json(path) -> dict:
    finished = call_cli("inspect", path, "--json")
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


def stored(tensors) -> tuple[int, int]:
    """(elements, bytes) of the distinct storages among `tensors`, as torch.save writes them."""
    unique = {t.untyped_storage().data_ptr(): t for t in tensors}
    return sum(t.numel() for t in unique.values()), sum(t.numel() * t.element_size() for t in unique.values())


def test_resume_file(small_run):
    info = inspect_json(small_run / "resume.pth")
    state = torch.load(small_run / "resume.pth", weights_only=True)
    assert (info["kind"], info["format"], info["version"], info["step"]) == ("resume", "exactresume.resume", 3, 3)
    assert info["description"].startswith("resume file (exactresume.resume version 3), step 3 of 8")
    assert info["checksum"] == "verified" and info["container"] == "torch"
    assert info["config"]["train"]["steps"] == 8 and info["config"]["model"]["vocab_size"] == 6400
    assert FP32_PARTS == set(info["parts"])
    model = info["parts"]["model"]
    assert model["tensors"] == len(state["model"]) and model["shared"] == 1
    assert (model["elements"], model["bytes"]) == stored(state["model"].values())
    assert model["dtypes"] == {"float32": model["bytes"]}
    optimizer_tensors = [t for s in state["optimizer"]["state"].values() for t in s.values()]
    assert info["parts"]["optimizer"]["tensors"] == len(optimizer_tensors)
    assert info["file_bytes"] == (small_run / "resume.pth").stat().st_size > info["total"]["bytes"]
    assert info["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_weights_file(small_run):
    info = inspect_json(small_run / "final.pth")
    assert info["kind"] == "weights" and info["checksum"] == "verified" and info["step"] is None
    assert list(info["parts"]) == ["model"] and info["parts"]["model"]["dtypes"].keys() == {"float32"}


def test_a_resume_file_saved_again_without_its_seal_is_shown_as_resume_refuses_it(tmp_path, small_run):
    torch.save(torch.load(small_run / "resume.pth", weights_only=True), tmp_path / "resaved.pth")
    info = inspect_json(tmp_path / "resaved.pth")
    assert (info["kind"], info["checksum"]) == ("resume", "absent")
    assert "--resume refuses it" in call_cli("inspect", tmp_path / "resaved.pth").stdout


def test_fp16_export_pt(small_run):
    info = inspect_json(small_run / "final_fp16.pt")
    fp32 = inspect_json(small_run / "final.pth")["parts"]["model"]
    model = info["parts"]["model"]
    assert info["kind"] == "export" and info["container"] == "torch" and "fp16" in info["description"]
    assert model["dtypes"].keys() == {"float16"} and model["elements"] == fp32["elements"]
    assert model["bytes"] * 2 == fp32["bytes"]


def test_safetensors_export_stores_the_tie_once(small_run):
    info = inspect_json(small_run / "resume_fp16.safetensors")
    fp32 = inspect_json(small_run / "final.pth")["parts"]["model"]
    assert (info["kind"], info["container"], info["checksum"]) == ("export", "safetensors", "verified")
    assert info["parts"]["model"]["tensors"] == fp32["tensors"] - 1  # lm_head.weight is not stored again
    assert info["parts"]["model"]["elements"] == fp32["elements"]
    assert info["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert info["config"]["model"]["hidden_size"] == 32  # a resume file records its config; the export keeps it


def test_sharded_folder(tmp_path, small_run):
    import torch.distributed.checkpoint as dcp

    model = torch.load(small_run / "final.pth", weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model, "step": 8}, checkpoint_id=tmp_path / "sharded")
    info = inspect_json(tmp_path / "sharded")
    assert (info["kind"], info["checksum"]) == ("sharded", "absent") and info["files"] >= 2
    assert info["parts"]["model"]["tensors"] == len(model)
    assert info["parts"]["model"]["elements"] == sum(t.numel() for t in model.values())
    assert info["parts"]["step"]["tensors"] == 0 and info["parts"]["step"]["bytes"] > 0


def test_sharded_resume_folder_has_its_commit_marker_verified(small_run):
    info = inspect_json(small_run / "resume.dcp")
    assert (info["kind"], info["commit"], info["checksum"], info["commit_problem"]) == (
        "sharded",
        "verified",
        "verified",
        None,
    )
    assert (info["format"], info["version"], info["processes"]) == ("exactresume.sharded", 1, 1)
    assert FP32_PARTS <= set(info["parts"]) and "not trusted" not in info["description"]


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_sharded_folder_without_a_commit_marker_is_shown_as_not_trusted(tmp_path, small_run):
    folder = Path(shutil.copytree(small_run / "resume.dcp", tmp_path / "copy.dcp"))
    (folder / "commit.pth").unlink()
    info = inspect_json(folder)
    assert (info["kind"], info["commit"], info["checksum"]) == ("sharded", "missing", "absent")
    assert "no commit marker (commit.pth)" in info["commit_problem"] and info["processes"] is None
    assert "not trusted" in info["description"] and info["parts"]["model"]["tensors"] > 0
    human = call_cli("inspect", folder).stdout
    assert "  commit     missing: " in human and "--resume refuses it" in human


@pytest.mark.parametrize(
    "damaged, problem",
    [("__0_0.distcp", "__0_0.distcp is damaged (checksum mismatch)"), ("commit.pth", "commit.pth: checksum mismatch")],
)
def test_sharded_folder_with_a_damaged_file_is_refused(tmp_path, small_run, damaged, problem):
    folder = Path(shutil.copytree(small_run / "resume.dcp", tmp_path / "copy.dcp"))
    flip_middle_byte(folder / damaged)
    for args in (("--json",), ()):
        assert_one_line_error(call_cli("inspect", folder, *args), problem)


def test_human_view_has_a_row_per_part(small_run):
    finished = call_cli("inspect", small_run / "resume.pth")
    assert finished.returncode == 0
    lines = finished.stdout.splitlines()
    assert "resume file" in lines[0] and "step 3 of 8" in lines[0]
    rows = {line.split()[0] for line in lines[1:]}
    assert FP32_PARTS | {"total", "checksum", "size", "tied"} <= rows


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("missing", "cannot read {}: No such file or directory"),
        ("empty", "{}: the file is empty (0 bytes)"),  # in the words --resume refuses it with
        ("random", "{}: not a torch file: it begins b"),  # b'…' or, holding a quote, b"…"
        ("truncated", "{}: damaged, truncated: the end of its zip archive is missing"),
        ("flipped", "{}: checksum mismatch, the file is damaged"),
        ("plain_folder", "{} is a folder holding no checkpoint (step-*.pth) and no sharded one"),
        ("bad_metadata", "{}/.metadata is not a readable DCP index"),
    ],
)
def test_bad_input_is_one_line(tmp_path, small_run, damage, reason):
    good = (small_run / "resume.pth").read_bytes()
    target = tmp_path / "bad.pth"
    if damage == "plain_folder":
        target.mkdir()
    elif damage == "bad_metadata":
        target.mkdir()
        (target / ".metadata").write_bytes(b"\x80\x04\x95" + os.urandom(64))
    elif damage != "missing":
        target.write_bytes(
            {
                "empty": b"",
                "random": os.urandom(4096),
                "truncated": good[: len(good) // 2],
                "flipped": good[:5000] + bytes([good[5000] ^ 1]) + good[5001:],
            }[damage]
        )
    assert_one_line_error(call_cli("inspect", target, "--json"), reason.format(target))


def test_damaged_safetensors_export_is_refused(tmp_path, small_run):
    data = bytearray((small_run / "resume_fp16.safetensors").read_bytes())
    data[-100] ^= 0x40
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    assert_one_line_error(call_cli("inspect", tmp_path / "bad.safetensors"), "checksum mismatch")


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "sharded"])
def test_a_checkpoint_pruned_while_inspect_reads_the_folder_is_left_out_not_a_traceback(tmp_path, monkeypatch, sharded):
    """A run saving every step prunes its oldest checkpoint while `inspect` lists the folder: the listing
    leaves the vanished one out (it printed a FileNotFoundError traceback)."""
    from exactresume import CheckpointStore
    from exactresume.store import listing

    model = torch.nn.Linear(3, 2)
    with CheckpointStore(tmp_path / "ckpt", keep=None, sharded=sharded) as store:
        for step in (1, 2, 3):
            store.save(step, {"model": model})
    read = listing._checkpoint

    def pruned_first(store, checkpoint, summarize):
        if checkpoint.step == 1:
            shutil.rmtree(checkpoint.path) if checkpoint.path.is_dir() else checkpoint.path.unlink()
        return read(store, checkpoint, summarize)

    monkeypatch.setattr(listing, "_checkpoint", pruned_first)
    finished = call_cli("inspect", tmp_path / "ckpt", "--json")
    assert finished.returncode == 0 and "Traceback" not in finished.stderr, finished.stderr
    assert [c["step"] for c in json.loads(finished.stdout)["checkpoints"]] == [2, 3]


def test_a_local_tier_that_is_the_folder_inspected_is_refused_in_one_line(tmp_path):
    """Its checkpoints would be listed twice, as both tiers', and "two tiers" said of one folder."""
    (tmp_path / "checkpoints").mkdir()
    finished = call_cli("inspect", tmp_path / "checkpoints", "--local-checkpoints", tmp_path / "." / "checkpoints")
    assert_one_line_error(finished, "is PATH itself: give the run's local tier")


def test_a_folder_a_live_run_prunes_and_saves_into_while_it_is_read_is_listed_as_it_stands(tmp_path, monkeypatch):
    """A run saving every step (keep=2) saved steps 3 and 4 and pruned 1 and 2 while `inspect` read them:
    the listing said "0 checkpoints; none verifies" of a folder a resume would take step 4 from. It lists
    the folder again until what it holds is read, and names the run writing it."""
    from exactresume import CheckpointStore
    from exactresume.store import listing

    model, read = torch.nn.Linear(3, 2), listing._checkpoint
    with CheckpointStore(tmp_path / "ckpt", keep=2) as run:
        for step in (1, 2):
            run.save(step, {"model": model})

        def saving_meanwhile(store, checkpoint, summarize):
            if checkpoint.step == 2 and run.checkpoints()[-1].step == 2:
                run.save(3, {"model": model})
                run.save(4, {"model": model})
            return read(store, checkpoint, summarize)

        monkeypatch.setattr(listing, "_checkpoint", saving_meanwhile)
        finished = call_cli("inspect", tmp_path / "ckpt", "--json")
        shown = call_cli("inspect", tmp_path / "ckpt").stdout
    info = json.loads(finished.stdout)
    assert finished.returncode == 0 and [c["step"] for c in info["checkpoints"]] == [3, 4], finished.stdout
    assert info["checksum"] == "verified" and info["newest_valid_step"] == 4 and info["writer"]["pid"] == os.getpid()
    assert f"(being written by pid {os.getpid()})" in shown and "a resume continues from step 4" in shown, shown
