"""Background saves (`--async-save`, `CheckpointStore(background=True)`): the same bytes as a synchronous
save, the state of the step given whatever the loop does next (copy="before-return", the default), a change during a
copy made while the loop runs (copy="during-next-step") refused rather than written, and failures
raised as one line with the previous checkpoint kept. Kills during a background write are in
test_fault_tolerance.py, resumed in new processes; users' loops in tests/users/test_background_user.py."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.errors import CheckpointError, StorageError, UserError
from exactresume.store.background import BEFORE_RETURN, DURING_NEXT_STEP, StagingMemory
from exactresume.store.faults import Fault, FaultPoints
from exactresume.store.numbered import CheckpointStore
from exactresume.store.resume import capture
from exactresume.training.loop import build_run, train
from helpers import SMALL, assert_one_line_error, call_cli, run_python


@pytest.fixture
def fp16_run(kjv_folder):
    """A run with every kind of part: tied weights, AdamW state, a loss scaler, generator and RNG states."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = build_run(TrainConfig(steps=6, batch=2, seq_len=16, dtype="fp16", dropout=0.1), load_tokens(kjv_folder))
    train(run, until=2)
    yield run
    torch.set_num_threads(threads)


class Loop:
    """A small loop of one's own: a model with BatchNorm, its optimizer, and an EMA of its state."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        self.ema = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.parts = {"model": self.model, "optimizer": self.optimizer, "ema": self.ema}
        self.step()

    def step(self) -> None:
        self.model(torch.randn(4, 8)).pow(2).mean().backward()  # BatchNorm's forward in train mode
        self.optimizer.step()
        self.optimizer.zero_grad()

    def update_ema(self, how: str = "lerp_") -> None:
        with torch.no_grad():
            for average, value in zip(self.ema.state_dict().values(), self.model.state_dict().values()):
                if not average.is_floating_point():
                    average.copy_(value)
                elif how == "lerp_":
                    average.lerp_(value, 0.1)
                else:
                    average.mul_(0.9).add_(value, alpha=0.1)


def file_bytes(store: CheckpointStore) -> dict:
    return {c.path.name: c.path.read_bytes() for c in store.checkpoints()}


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
def test_background_file_is_byte_identical_to_a_synchronous_save(fp16_run, tmp_path, mode):
    synchronous = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts())
    store = CheckpointStore(tmp_path / "background", background=True, copy=mode)
    background = store.save(2, fp16_run.parts())
    store.wait()
    assert background.read_bytes() == synchronous.read_bytes()
    assert "scaler" in fp16_run.parts()


def test_by_default_save_returns_with_the_copy_made(fp16_run, tmp_path):
    expected = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts()).read_bytes()
    store = CheckpointStore(tmp_path / "background", background=True)
    assert store.writer.copy == BEFORE_RETURN
    path = store.save(2, fp16_run.parts())
    with torch.no_grad():  # a change outside the optimizer, as an EMA update would make
        for parameter in fp16_run.model.parameters():
            parameter.add_(1.0)
    store.wait()
    assert path.read_bytes() == expected


def test_the_next_optimizer_step_waits_for_the_copy(fp16_run, tmp_path):
    """The built-in loop with copy="during-next-step": its forward and backward run during the copy and
    change nothing the guard counts (a change would refuse the save); its optimizer step waits."""
    expected = CheckpointStore(tmp_path / "sync").save(2, fp16_run.parts()).read_bytes()
    store = CheckpointStore(tmp_path / "background", background=True, copy=DURING_NEXT_STEP)
    copy = store.writer.staging.copy
    # The copy ends 0.3 s after the loop reached its next optimizer step, however busy the machine:
    # global step pre-hooks run before the store's own, which is the one that waits.
    reached = threading.Event()
    store.writer.staging.copy = lambda *args: (reached.wait(120), time.sleep(0.3), copy(*args))[2]
    handle = register_optimizer_step_pre_hook(lambda *args: reached.set())
    try:
        path = store.save(2, fp16_run.parts())
        train(fp16_run, until=4)  # the loop goes on: two optimizer steps change every weight and moment in place
        store.wait()
    finally:
        handle.remove()
    assert path.read_bytes() == expected
    assert store.blocked_seconds >= 0.3  # the first optimizer step waited for the copy


def test_what_the_version_counters_count():
    """What the guard relies on (and docs/library.md and copy_guard.py say it misses), on this torch."""
    loop = Loop()
    model, ema = loop.model.state_dict(), loop.ema.state_dict()
    counts = lambda state: {name: tensor._version for name, tensor in state.items()}
    assert model["0.weight"]._version == loop.model[0].weight._version  # a state dict's tensor shares the count
    before = counts(ema)
    loop.update_ema("lerp_")
    assert all(counts(ema)[name] > before[name] for name in ema)
    before = counts(ema)
    loop.update_ema("mul_/add_")
    assert all(counts(ema)[name] > before[name] for name in ema)
    before, mean = counts(model), model["1.running_mean"].clone()
    loop.model(torch.randn(4, 8))  # BatchNorm's forward in train mode
    assert not torch.equal(model["1.running_mean"], mean)
    assert counts(model)["1.num_batches_tracked"] > before["1.num_batches_tracked"]  # what the guard sees
    assert counts(model)["1.running_mean"] == before["1.running_mean"]  # the kernel's own update is not counted
    before = counts(ema)
    with torch.no_grad():
        loop.ema[0].weight.data.mul_(2)  # through .data: a new counter
    assert counts(ema) == before


def paused_copy(store: CheckpointStore, where: str) -> tuple[threading.Event, threading.Event]:
    """Make the writer's copy pause, before its first tensor or after its last, until the test says go on."""
    paused, go_on = threading.Event(), threading.Event()

    def pause() -> None:
        paused.set()
        go_on.wait(120)

    if where == "before the first tensor":
        copy_tensor, copied = store.writer.staging._copy_tensor, []
        store.writer.staging._copy_tensor = lambda *args: (copied or pause(), copied.append(1), copy_tensor(*args))[2]
    else:
        copy = store.writer.staging.copy
        store.writer.staging.copy = lambda *args: (copy(*args), pause())[0]
    return paused, go_on


@pytest.mark.parametrize(
    "change, named",
    [("ema lerp_", "ema.0.weight"), ("ema mul_/add_", "ema.0.weight"), ("BatchNorm", "model.1.num_batches_tracked")],
)
@pytest.mark.parametrize("where", ["before the first tensor", "after the last tensor"])
def test_a_change_racing_the_copy_is_refused_and_nothing_is_written(tmp_path, change, named, where):
    """Paused before its first tensor, the copy finds the change in the check after each tensor's copy;
    paused after its last, in the check of the whole state."""
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", keep=1, background=True, copy=DURING_NEXT_STEP)
    store.save(1, loop.parts)
    store.wait()
    before = file_bytes(store)
    paused, go_on = paused_copy(store, where)
    store.save(2, loop.parts)
    assert paused.wait(120)
    if change == "BatchNorm":
        loop.model(torch.randn(4, 8))  # the next step's forward, in train mode
    else:
        loop.update_ema(change.split()[1])
    go_on.set()
    with pytest.raises(CheckpointError) as refused:
        store.wait()
    message = str(refused.value)
    assert "\n" not in message and "step 2 was not written: " + named + " changed" in message, message
    assert "copy='before-return'" in message and "wait_for_copy()" in message, message
    assert file_bytes(store) == before and store.leftovers() == []
    store.writer.staging = StagingMemory()
    store.save(3, loop.parts)  # the store goes on: the next save is written
    store.wait()
    assert [c.step for c in store.checkpoints()] == [3]


class History:
    """A part whose state dict hands out a live list, which the loop keeps appending to."""

    def __init__(self):
        self.losses = [1.0]

    def state_dict(self) -> dict:
        return {"losses": self.losses}

    def load_state_dict(self, state: dict) -> None:
        self.losses = state["losses"]


def test_a_live_python_value_is_taken_at_save_not_at_the_copy(tmp_path):
    loop, history = Loop(), History()
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=DURING_NEXT_STEP)
    paused, go_on = paused_copy(store, "before the first tensor")
    path = store.save(1, loop.parts | {"history": history})
    assert paused.wait(120)
    history.losses.append(2.0)  # no tensor: the version counters cannot see it, so save took it already
    go_on.set()
    store.wait()
    assert torch.load(path, weights_only=True)["history"] == {"losses": [1.0]}


def test_the_optimizer_step_after_a_refused_copy_raises_it(tmp_path):
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=DURING_NEXT_STEP)
    paused, go_on = paused_copy(store, "before the first tensor")
    store.save(1, loop.parts)
    paused.wait(120)
    loop.update_ema()
    go_on.set()
    assert store.writer._guard.decided.wait(120)  # the writer found the change in its copy (before the next forward)
    with pytest.raises(CheckpointError, match="step 1 was not written: ema.0.weight changed"):
        loop.step()
    store.wait()  # reported once
    assert not store.path_for(1).exists()
    store.close()
    loop.step()  # close took the pre-hook off


def test_nothing_is_written_before_the_loop_waits_for_the_copy(tmp_path):
    """The decision is the loop's, where it waits for the copy: however fast the copy, a change the loop
    makes before then refuses the save, and until then nothing is written."""
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=DURING_NEXT_STEP)
    store.save(1, loop.parts)
    time.sleep(0.3)  # the copy is done long before
    assert store.checkpoints() == [] and store.busy()
    store.wait_for_copy()
    store.wait()
    assert [c.step for c in store.checkpoints()] == [1]
    store.save(2, loop.parts)
    time.sleep(0.3)
    loop.update_ema()  # long after the copy ended, still before the loop waited for it
    with pytest.raises(CheckpointError, match="step 2 was not written: ema.0.weight changed"):
        store.wait_for_copy()
    assert [c.step for c in store.checkpoints()] == [1]


def test_when_the_loop_thread_ends_without_waiting_the_writer_decides(tmp_path):
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=DURING_NEXT_STEP)
    thread = threading.Thread(target=store.save, args=(1, loop.parts))
    thread.start()
    thread.join()
    store.writer._writer.join(30)  # not store.wait(), which would decide in this thread
    assert [c.step for c in store.checkpoints()] == [1]
    store.wait()


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
def test_load_waits_for_the_save_in_flight_and_reads_it(tmp_path, mode):
    """A rollback right after a background save loads that save, not the one before it, and takes
    nothing from under its writer."""
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", background=True, copy=mode)
    store.save(1, loop.parts)
    store.wait_for_copy()  # the loop's BatchNorm changes its state in the forward
    loop.step()
    commit = store.commit
    store.commit = lambda *args, **kwargs: (time.sleep(0.5), commit(*args, **kwargs))[1]  # a slow disk
    store.save(2, loop.parts)
    at_two = {name: tensor.clone() for name, tensor in loop.model.state_dict().items()}
    store.wait_for_copy()
    loop.step()  # the write goes on
    assert store.busy()
    assert store.load(loop.parts) == 2
    assert all(torch.equal(loop.model.state_dict()[name], tensor) for name, tensor in at_two.items())
    store.close()


def test_a_second_store_of_the_folder_is_refused_while_the_first_ones_save_waits_for_its_writer(tmp_path):
    loop = Loop()
    first = CheckpointStore(tmp_path, background=True)
    commit = first.commit
    first.commit = lambda *args, **kwargs: (time.sleep(0.5), commit(*args, **kwargs))[1]  # a writer slow to start
    first.save(1, loop.parts)
    second = CheckpointStore(tmp_path)
    with pytest.raises(UserError, match="this process: another store of it on the folder, to close first"):
        second.load(loop.parts)  # a load cleans up, a writer's act: the folder is the first store's
    second.close()
    first.close()  # its save was not refused for the second store's lock
    assert [checkpoint.step for checkpoint in first.checkpoints()] == [1]


def test_a_closed_store_saves_and_loads_no_more_and_holds_no_lock(tmp_path):
    loop = Loop()
    with CheckpointStore(tmp_path / "checkpoints", background=True) as store:
        store.save(1, loop.parts)
    for call in (lambda: store.save(2, loop.parts), lambda: store.load(loop.parts)):
        with pytest.raises(UserError, match="checkpoints is closed: make a new CheckpointStore to save or load again"):
            call()
    again = CheckpointStore(tmp_path / "checkpoints")  # the folder is not held by the closed store
    assert again.load(loop.parts) == 1
    again.save(2, loop.parts)
    again.close()
    tiered = CheckpointStore(tmp_path / "durable", local=tmp_path / "local", durable_every=2, background=True)
    tiered.close()
    with pytest.raises(UserError, match=f"the store of {tmp_path / 'durable'} and {tmp_path / 'local'} is closed"):
        tiered.save(3, loop.parts)  # named as it was made: the durable folder, then the local one


EXITS_WITHOUT_CLOSE = """
import sys
import torch
from exactresume import CheckpointStore

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
store = CheckpointStore(sys.argv[1], background=True, copy="during-next-step")
store.save(1, {"model": model, "optimizer": optimizer})
with torch.no_grad():
    model.weight.mul_(2)  # before the loop waited for the copy; then the script ends
"""


@pytest.mark.parametrize("fork", [True, False])
def test_a_refusal_no_call_is_left_to_raise_is_said_at_the_exit(tmp_path, fork):
    """A script that changes the state after its last save and ends without close: at its exit the
    writer refuses the save, and the refusal is said on stderr, forked from a server as in a new process."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITHOUT_CLOSE)
    command = [sys.executable, str(script), str(tmp_path / "checkpoints")]
    if fork:
        finished = run_python(*command[1:])  # stdout and stderr together
    else:
        finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = finished.stdout
    assert finished.returncode == 0, output
    assert output.splitlines() == [
        "exactresume: the checkpoint at step 1 was not written: model.weight changed in place before the loop waited "
        "for its copy (with copy='during-next-step' the state is copied during the next step and may change only "
        "from the optimizer's step on); save with the default copy='before-return', or make the change after "
        "store.wait_for_copy()"
    ]
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_an_unknown_copy_mode_is_refused(tmp_path):
    with pytest.raises(UserError, match="copy must be 'before-return' or 'during-next-step', got 'overlap'"):
        CheckpointStore(tmp_path, background=True, copy="overlap")


def test_staging_memory_is_reused_and_keeps_tied_storage_shared(fp16_run):
    staging = StagingMemory()
    state = capture(fp16_run.parts(), 2)
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


@pytest.mark.parametrize("mode", [BEFORE_RETURN, DURING_NEXT_STEP])
@pytest.mark.parametrize("stage", ["write", "fsync", "rename", "verify"])
def test_a_failed_background_save_is_one_storage_error_line_and_the_previous_checkpoint_stays(tmp_path, stage, mode):
    loop = Loop()
    store = CheckpointStore(tmp_path / "checkpoints", keep=1, background=True, copy=mode)
    store.save(1, loop.parts)
    store.wait()
    before = file_bytes(store)
    store.faults = FaultPoints(Fault(stage, 1, "enospc"))
    store.save(2, loop.parts)  # returns: the error is the writer's
    with pytest.raises(StorageError) as failed:
        store.wait()
    message = str(failed.value)
    assert "\n" not in message and not message.startswith("("), message
    assert "checkpoint at step 2" in message and "(ENOSPC)" in message, message
    assert "step-00000001.pth is intact" in message, message
    assert failed.value.errno == errno.ENOSPC and isinstance(failed.value.__cause__, OSError)
    assert file_bytes(store) == before and store.leftovers() == []
    store.wait()  # reported once
    store.save(2, loop.parts)
    store.wait()
    assert [c.step for c in store.checkpoints()] == [2]


def test_a_bug_in_the_background_keeps_its_type_and_traceback(tmp_path):
    def commit(step, state, **publishing):
        raise KeyError("a bug")

    store = CheckpointStore(tmp_path / "checkpoints", background=True)
    store.commit = commit
    store.save(1, Loop().parts)
    with pytest.raises(KeyError) as failed:
        store.wait()
    assert "commit" in [frame.name for frame in traceback.extract_tb(failed.value.__traceback__)]


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
    assert "(EIO)" in line and "training stopped" in line, line
    assert [c.step for c in CheckpointStore(tmp_path / "checkpoints").checkpoints()] == [2]
    assert not (tmp_path / "final.pth").exists()
