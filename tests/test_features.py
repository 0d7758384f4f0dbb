"""Every training feature resumes bit-exactly: accumulation, dropout, bf16/fp16, the epoch loader with
workers, warmup. Each case trains straight and stops in this process, then resumes in a new one.

The matrix (8 steps, batch 2 x 16 tokens on the KJV; batch 4 on the tiny corpus, whose epoch is
4 steps with a short last batch of 3), each case combining features so six new processes cover:
- dropout with accumulation, stopped late; fp16 with its loss scaler and accumulation;
  bf16 with dropout and warmup, stopped inside the warmup;
- the epoch loader in bf16 with dropout, stopped mid-epoch (the resume trains the short batch, then
  the next epoch; its DataLoader must not draw from the global RNG that dropout uses);
- the epoch loader with 2 workers and dropout, stopped mid-epoch and resumed with 0 workers;
- the epoch loader with 2 workers, accumulation (the short batch splits into micro-batches of
  2 and 1) and dropout, stopped exactly at the epoch boundary and resumed with 0 workers.
"""

from __future__ import annotations

import pytest
import torch

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.core.steplog import read_loss_log, read_samples
from exactresume.errors import CheckpointError
from exactresume.store.resume import read_resume_file, restore
from exactresume.store.sealed import save_sealed
from exactresume.store.weights import read_weights
from exactresume.training.loop import build_run, lr_at, train
from helpers import SMALL, assert_one_line_error, call_cli, run_cli

EPOCH = ["--loader", "epoch", "--batch", "4"]

# name: (corpus, flags of every run, stop at, flags only the resume adds)
CASES = {
    "dropout-accum-late": ("kjv", ["--dropout", "0.1", "--grad-accum", "2"], 6, []),
    "fp16-scaler-accum": ("kjv", ["--dtype", "fp16", "--grad-accum", "2"], 3, []),
    "bf16-dropout-in-warmup": ("kjv", ["--dtype", "bf16", "--dropout", "0.1", "--warmup", "4"], 2, []),
    "epoch-mid-bf16-dropout": ("tiny", EPOCH + ["--dtype", "bf16", "--dropout", "0.1"], 3, []),
    "epoch-mid-workers-dropout": ("tiny", EPOCH + ["--workers", "2", "--dropout", "0.1"], 2, ["--workers", "0"]),
    "epoch-boundary-workers": (
        "tiny",
        EPOCH + ["--workers", "2", "--grad-accum", "2", "--dropout", "0.1"],
        4,
        ["--workers", "0"],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_resume_in_new_process_is_bit_identical(name, tmp_path, kjv_folder, tiny_folder):
    corpus, flags, stop_at, resume_flags = CASES[name]
    common = ["--data", kjv_folder if corpus == "kjv" else tiny_folder, *SMALL, *flags]
    straight = call_cli(
        "train",
        "--out",
        tmp_path,
        *common,
        "--weights",
        tmp_path / "straight.pth",
        "--log",
        tmp_path / "straight.csv",
        "--samples",
        tmp_path / "straight_samples.csv",
    )
    stopped = call_cli("train", "--out", tmp_path, *common, "--stop-at", stop_at, "--log", tmp_path / "stopped.csv")
    assert straight.returncode == 0 and stopped.returncode == 0, straight.stderr + stopped.stderr
    run_cli(
        "train",
        "--out",
        tmp_path,
        *common,
        *resume_flags,
        "--resume",
        tmp_path / "resume.pth",
        "--weights",
        tmp_path / "resumed.pth",
        "--log",
        tmp_path / "resumed.csv",
        "--samples",
        tmp_path / "resumed_samples.csv",
        check=True,
    )
    expected, got = read_weights(tmp_path / "straight.pth")[0], read_weights(tmp_path / "resumed.pth")[0]
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    straight_log, resumed_log = read_loss_log(tmp_path / "straight.csv"), read_loss_log(tmp_path / "resumed.csv")
    assert resumed_log == {step: straight_log[step] for step in range(stop_at + 1, 9)}
    straight_samples = read_samples(tmp_path / "straight_samples.csv")
    assert read_samples(tmp_path / "resumed_samples.csv") == {s: straight_samples[s] for s in range(stop_at + 1, 9)}


def test_resume_file_holds_the_loader_position_and_the_scaler(tmp_path, kjv_folder, tiny_folder):
    assert (
        call_cli("train", "--out", tmp_path / "e", "--data", tiny_folder, *SMALL, *EPOCH, "--stop-at", 3).returncode
        == 0
    )
    state = torch.load(tmp_path / "e" / "resume.pth", weights_only=True)
    assert (state["gen_state"]["epoch"], state["gen_state"]["cursor"]) == (0, 3)
    assert "scaler" not in state  # fp32: no loss scaler
    assert (
        call_cli(
            "train", "--out", tmp_path / "h", "--data", kjv_folder, *SMALL, "--dtype", "fp16", "--stop-at", 2
        ).returncode
        == 0
    )
    state = read_resume_file(tmp_path / "h" / "resume.pth")
    assert state["scaler"]["scale"] == 65536.0 and state["scaler"]["_growth_tracker"] == 2  # 2 steps without overflow
    run = build_run(TrainConfig(steps=8, batch=2, seq_len=16, dtype="fp16", preset="tiny"), load_tokens(kjv_folder))
    restore(state, run.parts())
    assert run.scaler.state_dict() == state["scaler"]


def test_batch_is_per_optimizer_step_whatever_the_accumulation(kjv_folder):
    """--grad-accum splits the same sequences into micro-batches: same samples, nearly the same loss."""
    data = load_tokens(kjv_folder)
    records = {}
    for accum in (1, 4):
        run = build_run(TrainConfig(steps=3, batch=4, seq_len=16, grad_accum=accum), data)
        records[accum] = []
        train(run, 3, records[accum].append)
    for one, four in zip(records[1], records[4]):
        assert torch.equal(one.starts, four.starts)
        assert abs(one.loss - four.loss) < 1e-4


def test_warmup_rises_linearly_then_follows_the_cosine():
    assert [lr_at(step, 10, 1.0, warmup=4) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, 10, 1.0, warmup=4) == 1.0
    assert lr_at(9, 10, 1.0, warmup=4) == lr_at(5, 6, 1.0)
    assert lr_at(3, 10, 2.0) == 2.0 * (
        0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * 3 / 10, dtype=torch.float64)).item())
    )


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--batch", "3", "--grad-accum", "2"], "--grad-accum 2"),
        (["--workers", "2"], "--loader epoch"),
        (["--warmup", "8"], "--warmup 8"),
        (["--dropout", "1"], "--dropout"),
    ],
)
def test_bad_feature_flags_are_one_line_errors(tmp_path, kjv_folder, flags, needle):
    assert_one_line_error(call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, *flags), needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_one_line_error(tmp_path, kjv_folder):
    assert_one_line_error(
        call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--device", "cuda"), "--device cuda"
    )
    assert not list(tmp_path.iterdir())


def test_resuming_with_another_feature_setting_is_refused(tmp_path, kjv_folder):
    assert call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--stop-at", 2).returncode == 0
    refused = call_cli(
        "train",
        "--out",
        tmp_path,
        "--data",
        kjv_folder,
        *SMALL,
        "--dropout",
        "0.1",
        "--resume",
        tmp_path / "resume.pth",
    )
    assert_one_line_error(refused, "different run", "dropout")


def test_a_resume_file_from_before_the_feature_fields_resumes_with_their_defaults(tmp_path, kjv_folder):
    assert call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--stop-at", 2).returncode == 0
    state = read_resume_file(tmp_path / "resume.pth")
    for name in ("grad_accum", "dropout", "dtype", "loader", "warmup", "device"):
        del state["config"]["train"][name]
    save_sealed(tmp_path / "old.pth", state)
    data = load_tokens(kjv_folder)
    run = build_run(TrainConfig(steps=8, batch=2, seq_len=16, preset="tiny"), data)
    restore(read_resume_file(tmp_path / "old.pth"), run.parts())
    assert run.step.value == 2
    with pytest.raises(CheckpointError, match="dropout"):
        restore(
            read_resume_file(tmp_path / "old.pth"),
            build_run(TrainConfig(steps=8, batch=2, seq_len=16, dropout=0.1, preset="tiny"), data).parts(),
        )
