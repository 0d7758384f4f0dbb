"""Background saves pickled in a helper process (`serializer="process"`, `train --async-save process`):
the bytes the writer thread's own torch.save would write, the writer pickling again when the helper is
not there, and no helper left behind by a store that closed or a training process killed."""

from __future__ import annotations

import collections
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from exactresume.errors import FieldError
from exactresume.store.background import DURING_NEXT_STEP, StagingMemory
from exactresume.store.numbered import CheckpointStore
from exactresume.store.sealed import Serialized, save_unsealed, verify
from exactresume.store.serializer import SerializerProcess, available
from helpers import SMALL, assert_one_line_error, train_cli

pytestmark = pytest.mark.skipif(not available(), reason="the helper's shared memory is Linux's memfd")
READY_SECONDS = 60  # a cold Python importing torch, on a busy machine


def _made_in(pid: int) -> OnlyHere:
    if os.getpid() != pid:
        raise RuntimeError("this value is unpickled only in the process that made it")
    return OnlyHere()


class OnlyHere:
    """A value the helper fails to unpickle: the writer pickles the state itself."""

    def __reduce__(self):
        return _made_in, (os.getpid(),)


def a_state() -> dict:
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    embedding, head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
    head.weight = embedding.weight
    model = collections.OrderedDict(linear.state_dict())
    model._metadata = {"": {"version": 1}}  # as a module's state dict carries it
    return {
        "model": model,
        "tied": {"embedding": embedding.weight, "head": head.weight},
        "view": linear.weight[2:, 1:3],
        "empty": torch.empty(0),
        "empty_rows": torch.zeros(0, 3),
        "half": torch.randn(5).half(),
        "rng": torch.get_rng_state(),
        "position": [1, 2, (3, "epoch")],
        "step": 7,
    }


def torch_saved(staged) -> bytes:
    file = io.BytesIO()
    save_unsealed(staged, file)
    return file.getvalue()


def helper_bytes(helper: SerializerProcess, staged, arena) -> bytes | None:
    """The helper's bytes of `staged`, once it is ready; None where the writer must pickle it."""
    deadline = time.monotonic() + READY_SECONDS
    while True:
        with helper.serialized(staged, arena) as payload:
            if isinstance(payload, Serialized):
                return bytes(payload.view)
        if helper._out_fd >= 0 or time.monotonic() > deadline:  # ready (it declined this state), or never
            return None
        time.sleep(0.05)


def test_the_helper_writes_the_bytes_the_writer_would_and_ends_with_its_store():
    staging, helper = StagingMemory(shared=True), SerializerProcess()
    state = a_state()
    staged = staging.copy(state)
    try:
        assert helper_bytes(helper, staged, staging.arena) == torch_saved(staged)
        # the state's storages changed: a new arena, sent once, and the same bytes again
        grown = staging.copy({**state, "more": torch.ones(3)})
        assert helper_bytes(helper, grown, staging.arena) == torch_saved(grown)
        # a value the helper fails on: the writer pickles the state itself, and the helper serves on
        odd = staging.copy({**state, "odd": OnlyHere()})
        assert helper_bytes(helper, odd, staging.arena) is None
        again = staging.copy(state)
        assert helper_bytes(helper, again, staging.arena) == torch_saved(again)
        process = helper._process
    finally:
        helper.close()
    assert process.returncode == 0  # it ended by itself once its socket closed, not killed


def test_a_helper_whose_training_process_dies_as_it_starts_ends_without_a_word(capfd):
    helper = SerializerProcess()
    helper._start()
    process = helper._process
    helper._socket.close()  # as a training process killed while its helper imports torch
    assert process.wait(READY_SECONDS) == 0
    assert capfd.readouterr().err == ""


def test_a_helper_gone_mid_run_leaves_the_saves_to_the_writer_with_one_line(tmp_path, capfd):
    store = CheckpointStore(tmp_path, keep=2, background=True, copy=DURING_NEXT_STEP, serializer="process")
    model = torch.nn.Linear(16, 16)
    helper, step = store.writer.serializer, 0
    deadline = time.monotonic() + READY_SECONDS
    while helper._out_fd < 0 and time.monotonic() < deadline:  # saves until the helper is ready
        step += 1
        store.save(step, {"model": model})
        store.wait()
        time.sleep(0.05)
    assert helper._out_fd >= 0, "the helper never started"
    helper._process.kill()
    for _ in range(3):
        step += 1
        with torch.no_grad():
            model.weight.add_(1.0)
        store.save(step, {"model": model})
        store.wait()
    store.close()
    said = capfd.readouterr().err
    assert said.count("the process that pickles background saves is gone") == 1, said
    assert "Traceback" not in said
    newest = store.checkpoints()[-1]
    verify(newest.path)
    assert newest.step == step
    assert torch.equal(torch.load(newest.path, weights_only=True)["model"]["weight"], model.weight)


USER_SCRIPT = """
    # A user's script without a __main__ guard: the helper must not run it again.
    import os, sys, time, torch
    from exactresume import CheckpointStore
    folder, marks = sys.argv[1], sys.argv[2]
    with open(marks, "a") as file:
        file.write(f"started {os.getpid()}\\n")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = CheckpointStore(folder, keep=2, background=True, copy="during-next-step", serializer="process")
    step, ready_at = 0, None
    while ready_at is None or step < ready_at + 5:
        step += 1
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        store.save(step, {"model": model, "optimizer": optimizer})
        if ready_at is None and store.writer.serializer._out_fd >= 0:
            ready_at = step
        time.sleep(0.02)
    store.wait()
    saved = torch.load(store.checkpoints()[-1].path, weights_only=True)
    same = all(torch.equal(saved["model"][name], value) for name, value in model.state_dict().items())
    with open(marks, "a") as file:
        file.write(f"helper {store.writer.serializer._process.pid} same {same} step {step}\\n")
    while True:  # saving until the test kills this process
        step += 1
        store.save(step, {"model": model, "optimizer": optimizer})
        time.sleep(0.02)
"""


def test_a_script_pickling_in_a_helper_runs_once_and_a_kill_ends_its_helper(tmp_path):
    script, marks = tmp_path / "train.py", tmp_path / "marks.txt"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    child = subprocess.Popen([sys.executable, script, tmp_path / "checkpoints", marks], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 2 * READY_SECONDS
    while "helper" not in (marks.read_text() if marks.exists() else "") and child.poll() is None:
        assert time.monotonic() < deadline, "the script never reported its helper"
        time.sleep(0.1)
    lines = marks.read_text().splitlines()
    assert child.poll() is None, child.stderr.read().decode()
    child.kill()
    child.wait()
    assert [line.split()[0] for line in lines] == ["started", "helper"]  # the script ran once
    _, pid, _, same, _, step = lines[1].split()
    assert same == "True", lines  # the newest checkpoint holds the model's state at its step
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        assert time.monotonic() < deadline, "the helper outlived the killed training process"
        time.sleep(0.05)
    for checkpoint in CheckpointStore(tmp_path / "checkpoints").checkpoints():
        verify(checkpoint.path)
    assert child.stderr.read() == b""


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_train_async_save_process_saves_the_run_it_trains(tmp_path, kjv_folder):
    finished = train_cli(tmp_path, "--data", kjv_folder, *SMALL, "--save-every", 1, "--async-save", "process")
    assert finished.returncode == 0, finished.stderr
    newest = CheckpointStore(tmp_path / "checkpoints").checkpoints()[-1]
    assert newest.step == 8
    saved = torch.load(newest.path, weights_only=True)["model"]
    final = torch.load(tmp_path / "final.pth", weights_only=True)
    assert saved.keys() == final.keys() and all(torch.equal(saved[name], final[name]) for name in final)


def test_a_serializer_named_wrong_or_without_background_is_refused_in_one_line(tmp_path, kjv_folder):
    with pytest.raises(FieldError, match="serializer must be 'thread' or 'process', got 'proces'"):
        CheckpointStore(tmp_path / "a", background=True, serializer="proces")
    with pytest.raises(FieldError, match="give background=True with it"):
        CheckpointStore(tmp_path / "b", serializer="process")
    finished = train_cli(tmp_path / "c", "--data", kjv_folder, *SMALL, "--save-every", 1, "--async-save", "proces")
    assert_one_line_error(finished, "--async-save", "did you mean process?")
