"""A checkpoint every step in the background (`--save-every 1 --async-save`): a save asked for while
the one before is still being written is skipped and counted, never queued; one that is only reading
its published file back and pruning does not skip the next, which is written meanwhile and published after it."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch

from exactresume.errors import CheckpointError, FieldError, StorageError
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


def _held_at_the_read_back(store: CheckpointStore, failure: OSError | None = None):
    """Hold the store's first save at its read-back (after its file is published) until the returned
    event is set, then let it go on, or fail there with `failure`; the stages reached, in order, are listed."""
    reading, release, stages = threading.Event(), threading.Event(), []
    reached = store.faults.reached

    def held(stage: str) -> None:
        stages.append(stage)
        if stage == "verify" and not reading.is_set():
            reading.set()
            release.wait(10)
            if failure is not None:
                raise failure
        reached(stage)

    store.faults.reached = held
    return reading, release, stages


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
def test_a_save_still_reading_its_file_back_does_not_skip_the_next_which_is_published_after_it(tmp_path, mode):
    store = CheckpointStore(tmp_path / "checkpoints", keep=1, background=True, copy=mode)
    reading, release, stages = _held_at_the_read_back(store)
    parts = {"model": torch.nn.Linear(4, 4)}
    store.save(1, parts, coalesce=True)
    store.wait_for_copy()  # the loop's optimizer step: the first save may be published
    assert reading.wait(10)
    assert store.save(2, parts, coalesce=True) == store.path_for(2) and store.coalesced == 0
    if mode == DURING_NEXT_STEP:
        store.wait_for_copy()
    deadline = time.monotonic() + 10
    while stages.count("fsync") < 2 and time.monotonic() < deadline:  # the second is written meanwhile
        time.sleep(0.01)
    assert stages.count("fsync") == 2 and stages.count("rename") == 1  # but not published before the first ends
    release.set()
    store.wait()
    assert [checkpoint.step for checkpoint in store.checkpoints()] == [2]  # the first pruned once the second was in
    second_rename = [i for i, stage in enumerate(stages) if stage == "rename"][1]
    assert stages.index("retention") < second_rename  # the first ended before the second was published
    assert stages[second_rename:] == ["rename", "folder-fsync", "verify", "retention"]
    store.close()


def test_a_save_that_fails_at_its_read_back_drops_the_save_asked_for_meanwhile_and_is_raised_next(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=DURING_NEXT_STEP)
    failure = OSError(errno.EIO, "the disk returned other bytes")
    reading, release, _ = _held_at_the_read_back(store, failure)
    parts = {"model": torch.nn.Linear(4, 4)}
    store.save(1, parts)
    store.wait_for_copy()
    assert reading.wait(10)
    store.save(2, parts)  # accepted: the first has not failed yet
    store.wait_for_copy()
    release.set()
    with pytest.raises(StorageError, match="checkpoint at step 1") as raised:
        store.wait()  # the second is not published
    assert raised.value.__cause__ is failure
    assert store.checkpoints() == [] and not list((tmp_path / "checkpoints").glob("*.tmp"))
    store.save(3, parts)  # the store goes on
    store.wait()
    assert [checkpoint.step for checkpoint in store.checkpoints()] == [3]
    store.close()


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
def test_a_save_still_reading_its_file_back_is_the_stores_own_as_a_synchronous_save_is(tmp_path, mode):
    store = CheckpointStore(tmp_path / "checkpoints", keep=None, background=True, copy=mode)
    reading, release, _ = _held_at_the_read_back(store)
    parts = {"model": torch.nn.Linear(4, 4)}
    store.save(2, parts)
    store.wait_for_copy()
    assert reading.wait(10)
    with pytest.raises(CheckpointError, match="a later step of this run than the 1 being saved"):  # not another run's
        store.save(1, parts)
    assert store.save(2, parts) == store.path_for(2)  # the same step again: written over, not refused as not loaded
    release.set()
    store.save(3, parts)
    store.wait()
    assert [checkpoint.step for checkpoint in store.checkpoints()] == [2, 3]
    store.close()


def test_a_step_that_went_back_is_refused_with_coalesce_too_not_skipped(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", keep=None, background=True)
    released = threading.Event()
    commit = store.commit
    store.commit = lambda step, state, **publish: (released.wait(10), commit(step, state, **publish))[1]  # slow disk
    parts = {"model": torch.nn.Linear(4, 4)}
    store.save(5, parts, coalesce=True)
    with pytest.raises(FieldError, match="step"):
        store.save("6", parts, coalesce=True)  # no step: refused while the save before is written, not skipped
    threading.Timer(0.2, released.set).start()
    with pytest.raises(CheckpointError, match="a later step of this run than the 3 being saved"):
        store.save(3, parts, coalesce=True)  # waits for step 5, then is told as a synchronous store tells it
    assert store.coalesced == 0 and store.save(6, parts, coalesce=True) == store.path_for(6)
    store.close()
