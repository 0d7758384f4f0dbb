"""The plan before the first step: a run that cannot fit its memory or its disk is refused at once,
without a tensor; --force starts it anyway; --dry-run prints the plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import exactresume.training.plan as plan_module
from exactresume.config import PRESETS, TrainConfig
from exactresume.core.data import load_tokens
from exactresume.core.model import MiniMindLM
from exactresume.store.numbered import CheckpointStore
from exactresume.training.loop import build_run
from exactresume.training.plan import check_disk, parameter_count, plan_run
from helpers import SMALL, assert_one_line_error, call_cli, run_cli

OVERSIZED = ["--seq-len", "32768", "--batch", "64"]  # terabytes of attention scores


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_is_the_models(name):
    with torch.device("meta"):  # shapes only, no memory
        model = MiniMindLM(PRESETS[name])
    assert parameter_count(PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_checkpoint_estimate_is_close_to_a_real_checkpoint(tmp_path, kjv_folder):
    config = TrainConfig(steps=8, batch=2, seq_len=16)
    run = build_run(config, load_tokens(kjv_folder))
    run.optimizer.zero_grad()
    run.model.loss(*run_batch(config)).backward()
    run.optimizer.step()  # AdamW's state exists only after a step
    with CheckpointStore(tmp_path) as store:
        size = store.save(1, run.parts()).stat().st_size
    estimate = plan_run(config).checkpoint_bytes
    assert size <= estimate <= 1.05 * size


def run_batch(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, PRESETS[config.preset].vocab_size, (config.batch, config.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_oversized_run_is_refused_at_once_without_tensors(tmp_path, kjv_folder, monkeypatch):
    import exactresume.training.job_run as job_module

    monkeypatch.setattr(job_module, "build_run", lambda *args: pytest.fail("the run was built"))
    started = time.perf_counter()
    finished = call_cli("train", "--out", tmp_path / "run", "--data", kjv_folder, *OVERSIZED)
    elapsed = time.perf_counter() - started
    assert_one_line_error(finished, "this run needs about", "TB of memory", "available; lower --batch or --seq-len")
    assert elapsed < 0.5, elapsed
    assert not (tmp_path / "run").exists()
    # In a new process it is refused before torch is even imported.
    script = (
        "import sys; from exactresume.cli import main; code = main(sys.argv[1:]);"
        "assert 'torch' not in sys.modules; sys.exit(code)"
    )
    argv = ["train", "--out", str(tmp_path / "run"), "--data", str(kjv_folder), *OVERSIZED]
    child = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True)
    assert child.returncode == 2 and "needs about" in child.stderr, child.stderr


def test_sequence_beyond_the_position_table_is_refused_even_with_force(tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, "--seq-len", 100000, "--force")
    assert_one_line_error(finished, "--seq-len 100000 is beyond the model's max_position_embeddings (32768)")


def test_force_starts_a_run_the_estimate_refuses(tmp_path, kjv_folder, monkeypatch):
    monkeypatch.setattr(plan_module, "available_memory", lambda: 1_000_000)  # a 1 MB machine
    refused = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL)
    assert_one_line_error(refused, "needs about", "1.0 MB available", "--force to start anyway")
    torch.set_num_threads(1)
    forced = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "--force: starting although this run needs about" in forced.stdout


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, kjv_folder):
    folder = tmp_path / "run"
    finished = call_cli("train", "--out", folder, "--data", kjv_folder, "--save-every", 10, "--dry-run")
    assert finished.returncode == 0, finished.stderr
    for needle in ("1,705,344 parameters", "memory: about", "checkpoint: about 21 MB each", "verdict: fits"):
        assert needle in finished.stdout, finished.stdout
    assert "disk: about 83 MB free needed (3 checkpoints kept by --keep and 1 being written)" in finished.stdout
    assert not folder.exists()


def test_disk_that_cannot_hold_the_kept_checkpoints_is_refused_before_the_first(small_disk, kjv_folder):
    folder = small_disk / "run"
    default = ["--preset", "default"]  # checkpoints of 21 MB, on a disk of 31
    finished = call_cli(
        "train", "--out", folder, "--data", kjv_folder, *SMALL, *default, "--save-every", 2, "--keep", 2
    )
    assert_one_line_error(
        finished, "needs about 62 MB free for 2 checkpoints kept by --keep and 1 being written", "31 MB free"
    )
    assert not folder.exists()


def test_disk_check_counts_the_checkpoints_retention_will_delete(tmp_path, monkeypatch):
    plan = plan_run(TrainConfig(), save_every=2, keep=2)
    for step in (2, 4):  # two checkpoints already there (sparse files of the right size)
        with open(tmp_path / f"step-{step:08d}.pth", "wb") as file:
            file.truncate(plan.checkpoint_bytes)
    existing = plan_module.existing_checkpoints(tmp_path)
    assert existing == 2 * plan.checkpoint_bytes
    monkeypatch.setattr(plan_module, "free_space", lambda folder: int(1.5 * plan.checkpoint_bytes))
    check_disk(plan, tmp_path, existing)  # room for the one being written
    monkeypatch.setattr(plan_module, "free_space", lambda folder: plan.checkpoint_bytes // 2)
    with pytest.raises(plan_module.UserError, match="needs about 21 MB free"):
        check_disk(plan, tmp_path, existing)
    assert os.path.getsize(tmp_path / "step-00000002.pth") == plan.checkpoint_bytes


def test_the_plan_takes_the_tokenizers_vocabulary(tmp_path, tiny_folder):
    params = parameter_count(replace(PRESETS["default"], vocab_size=270))  # tiny_folder's tokenizer
    finished = call_cli("train", "--out", tmp_path, "--data", tiny_folder, "--dry-run")
    assert finished.returncode == 0 and f"{params:,} parameters" in finished.stdout, finished.stdout


def test_fsdp_divides_the_weights_gradients_and_adamw_among_the_processes():
    config = TrainConfig(preset="minimind-26m", shard="fsdp")
    whole, sharded = plan_module.plan_run(config, processes=1), plan_module.plan_run(config, processes=4)
    for part in ("weights", "gradients", "adamw"):
        assert sharded.memory[part] == -(-whole.memory[part] // 4 // 4) * 4  # a quarter, rounded up to a float
    assert "gathered" in sharded.memory and "gathered" not in whole.memory
    ddp = plan_module.plan_run(replace(config, shard="none"), processes=4)
    assert ddp.memory["adamw"] == whole.memory["adamw"]


@pytest.mark.parametrize(
    "flags",
    [["--dropout", "0.1"], ["--dtype", "bf16"], ["--nproc", "2", "--shard", "fsdp"]],
    ids=["dropout", "bf16", "fsdp-2"],
)
def test_the_estimate_errs_high_by_at_most_half_against_a_real_runs_peak(tmp_path, kjv_folder, flags):
    """The plan against what a run really holds (bench/plan_memory.py measures every preset and mode)."""
    train = ["train", "--out", tmp_path, "--data", kjv_folder, "--steps", 3, "--batch", 8, "--seq-len", 128]
    finished = run_cli(*train, *flags, "--json", check=True)
    memory = json.loads(finished.stdout)["memory"]
    assert 1.0 <= memory["planned_bytes"] / memory["peak_bytes"] <= 1.5, memory
