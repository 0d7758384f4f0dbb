"""Background saves (`--async-save`): the same bytes as a synchronous save, copied before the next
optimizer step changes the state, with failures reported and the previous checkpoint kept. Kills during a background
write are in test_fault_tolerance.py, resumed in new processes."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import SMALL, assert_one_line_error, call_cli
from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.store.background import BackgroundSaveFailed, BackgroundSaver, StagingMemory
from exactresume.store.faults import Fault, FaultPoints
from exactresume.store.folder import CheckpointStore
from exactresume.store.numbered import snapshot
from exactresume.training.loop import build_run, train


@pytest.fixture
def fp16_run(kjv_folder):
    """A run with every kind of part: tied weights, AdamW state, a loss scaler, generator and RNG states."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = build_run(TrainConfig(steps=6, batch=2, seq_len=16, dtype="fp16", dropout=0.1), load_tokens(kjv_folder))
    train(run, until=2)
    yield run
    torch.set_num_threads(threads)


def test_background_file_is_byte_identical_to_a_synchronous_save(fp16_run, tmp_path):
    synchronous = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts())
    saver = BackgroundSaver(CheckpointStore(tmp_path / "background"))
    background = saver.save(2, fp16_run.parts())
    saver.wait()
    assert background.read_bytes() == synchronous.read_bytes()
    assert "scaler" in fp16_run.parts()


def test_the_next_optimizer_step_waits_for_the_copy(fp16_run, tmp_path):
    expected = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts()).read_bytes()
    saver = BackgroundSaver(CheckpointStore(tmp_path / "background"))
    copy = saver.staging.copy
    # The copy ends 0.3 s after the loop reached its next optimizer step, however busy the machine:
    # global step pre-hooks run before the saver's own, which is the one that waits.
    reached = threading.Event()
    saver.staging.copy = lambda state: (reached.wait(120), time.sleep(0.3), copy(state))[2]
    handle = register_optimizer_step_pre_hook(lambda *args: reached.set())
    try:
        path = saver.save(2, fp16_run.parts())
        train(fp16_run, until=4)  # the loop goes on: two optimizer steps change every weight and moment in place
        saver.wait()
    finally:
        handle.remove()
    assert path.read_bytes() == expected
    assert saver.blocked_seconds >= 0.3  # the first optimizer step waited for the copy


def test_without_overlap_save_returns_with_the_copy_made(fp16_run, tmp_path):
    expected = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts()).read_bytes()
    saver = BackgroundSaver(CheckpointStore(tmp_path / "background"), overlap=False)
    path = saver.save(2, fp16_run.parts())
    with torch.no_grad():  # a change outside the optimizer, as an EMA update would make
        for parameter in fp16_run.model.parameters():
            parameter.add_(1.0)
    saver.wait()
    assert path.read_bytes() == expected


def test_staging_memory_is_reused_and_keeps_tied_storage_shared(fp16_run):
    staging = StagingMemory()
    state = snapshot(2, fp16_run.parts())
    first = staging.copy(state)
    pool = [storage.data_ptr() for storage in staging.pool]
    second = staging.copy(state)
    assert [storage.data_ptr() for storage in staging.pool] == pool
    model = second["model"]
    assert (
        model["lm_head.weight"].untyped_storage().data_ptr()
        == model["model.embed_tokens.weight"].untyped_storage().data_ptr()
    )
    assert (
        model["lm_head.weight"].untyped_storage().data_ptr()
        != state["model"]["lm_head.weight"].untyped_storage().data_ptr()
    )
    for name, tensor in state["model"].items():
        assert torch.equal(first["model"][name], tensor), name


@pytest.mark.parametrize("stage", ["write", "fsync", "rename", "verify"])
def test_a_failed_background_save_is_raised_by_wait_and_the_previous_checkpoint_stays(fp16_run, tmp_path, stage):
    store = CheckpointStore(tmp_path / "checkpoints", keep=1)
    saver = BackgroundSaver(store)
    saver.save(1, fp16_run.parts())
    saver.wait()
    store.faults = FaultPoints(Fault(stage, 1, "enospc"))
    saver.save(2, fp16_run.parts())  # returns: the error is the writer's
    with pytest.raises(BackgroundSaveFailed) as failed:
        saver.wait()
    assert failed.value.step == 2 and failed.value.error.errno == errno.ENOSPC
    assert [c.step for c in store.checkpoints()] == [1] and store.leftovers() == []
    saver.wait()  # reported once
    saver.save(2, fp16_run.parts())
    saver.wait()
    assert [c.step for c in store.checkpoints()] == [2]


def test_async_save_needs_save_every(tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--async-save")
    assert_one_line_error(finished, "--async-save needs --save-every")
    assert not (tmp_path / "final.pth").exists()


def test_a_disk_error_in_the_background_stops_the_run_with_exit_74(tmp_path, kjv_folder, monkeypatch):
    monkeypatch.setenv("EXACTRESUME_FAULT", "fsync@2:eio")
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--save-every", 2, "--async-save")
    assert finished.returncode == 74, finished.stderr
    line = finished.stderr.strip()
    assert "\n" not in line and "checkpoint at step 4" in line and "step-00000002.pth is intact" in line, line
    assert [c.step for c in CheckpointStore(tmp_path / "checkpoints").checkpoints()] == [2]
    assert not (tmp_path / "final.pth").exists()
