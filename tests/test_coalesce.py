"""A checkpoint every step in the background (`--save-every 1 --async-save`): a save asked for while
the one before is still being written is skipped and counted, never queued."""

from __future__ import annotations

import threading

import pytest
import torch

from exactresume.store.background import BEFORE_RETURN, DURING_NEXT_STEP
from exactresume.store.numbered import CheckpointStore
from helpers import SMALL, train_cli


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
def test_saves_asked_for_while_one_is_written_are_skipped_and_counted(tmp_path, mode):
    store = CheckpointStore(tmp_path / "checkpoints", keep=None, background=True, copy=mode)
    released = threading.Event()
    commit = store.commit
    store.commit = lambda step, state, **publish: (released.wait(10), commit(step, state, **publish))[1]  # slow disk
    parts = {"model": torch.nn.Linear(4, 4)}
    assert store.save(1, parts, coalesce=True) == store.path_for(1)
    assert store.save(2, parts, coalesce=True) is None and store.save(3, parts, coalesce=True) is None
    assert store.coalesced == 2
    released.set()
    store.wait()
    assert store.save(4, parts, coalesce=True) == store.path_for(4)
    store.wait()
    assert [checkpoint.step for checkpoint in store.checkpoints()] == [1, 4]
    assert store.save(5, parts) == store.path_for(5)  # without coalesce: waits, as before
    store.wait()


def test_every_step_with_async_save_ends_with_the_final_checkpoint(tmp_path, kjv_folder):
    finished = train_cli(tmp_path, "--data", kjv_folder, *SMALL, "--save-every", 1, "--async-save")
    assert finished.returncode == 0, finished.stderr
    steps = [checkpoint.step for checkpoint in CheckpointStore(tmp_path / "checkpoints").checkpoints()]
    assert steps[-1] == 8 and len(steps) <= 3  # the newest three of those written (--keep 3)
    skipped = [line for line in finished.stdout.splitlines() if "skipped" in line]
    assert len(skipped) <= 1
