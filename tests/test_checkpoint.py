"""Atomic, sealed writes and restore-by-parts."""

from __future__ import annotations

import fcntl
import random

import numpy as np
import pytest
import torch

from exactresume import atomic
from exactresume.errors import CheckpointError, UserError
from exactresume.parts import GlobalRng, StepCounter
from exactresume.store.resume import capture, restore
from exactresume.store.sealed import load_sealed, read_seal, save_sealed, write_sealed
from exactresume.training.run_identity import RunIdentity
from helpers import run_python


def test_interrupted_write_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "resume.pth"
    save_sealed(path, {"step": 1, "w": torch.ones(4)})
    before = path.read_bytes()

    def crash_before_rename(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", crash_before_rename)
    with pytest.raises(OSError):
        save_sealed(path, {"step": 2, "w": torch.zeros(4)})
    assert path.read_bytes() == before
    assert load_sealed(path)["step"] == 1


def test_process_killed_before_rename_leaves_previous_file(tmp_path):
    path = tmp_path / "resume.pth"
    save_sealed(path, {"step": 1})
    # A child that dies (SIGKILL) after writing and fsyncing the .tmp, before os.replace.
    script = f"""
import os, signal, torch
from exactresume import atomic
from exactresume.store.sealed import save_sealed
atomic.os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL)
save_sealed(r"{path}", {{"step": 2, "w": torch.ones(1000)}})
"""
    (tmp_path / "killed.py").write_text(script)
    assert run_python(tmp_path / "killed.py").returncode == -9
    assert load_sealed(path) == {"step": 1}
    assert (tmp_path / "resume.pth.tmp").exists()  # the crash's leftover; the good file is untouched


def test_atomic_write_reports_each_stage_in_order(tmp_path):
    stages: list[str] = []
    atomic.atomic_write(tmp_path / "f", lambda file: file.write(b"x" * 100), stage=stages.append, expected_bytes=100)
    assert stages == ["write", "fsync", "rename", "folder-fsync"]
    assert (tmp_path / "f").read_bytes() == b"x" * 100


def test_a_stage_that_fails_leaves_no_tmp_and_its_os_error_survives_torch_save(tmp_path):
    def disk_full_halfway(stage: str) -> None:
        if stage == "write":
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as failure:
        atomic.atomic_write(
            tmp_path / "f.pth",
            lambda file: write_sealed(file, {"w": torch.ones(1000)}),
            stage=disk_full_halfway,
            expected_bytes=4000,
        )
    assert failure.value.errno == 28  # not torch.save's RuntimeError about zip positions
    assert list(tmp_path.iterdir()) == []


def test_a_second_writer_of_the_same_path_at_the_same_moment_is_refused_and_changes_nothing(tmp_path):
    """Two processes saving one path at once (every rank of a torchrun job, say) once wrote into one
    temporary file and published the mix; flock conflicts between two opens even in one process."""
    path = tmp_path / "resume.pth"
    save_sealed(path, {"step": 1})
    with open(atomic.tmp_path(path), "wb") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        other.write(b"the other writer's bytes")
        other.flush()
        with pytest.raises(UserError, match="is being written by another process at this moment"):
            save_sealed(path, {"step": 2})
        assert atomic.tmp_path(path).read_bytes() == b"the other writer's bytes"
    assert load_sealed(path) == {"step": 1}
    save_sealed(path, {"step": 3})  # a leftover no process holds is written over
    assert load_sealed(path) == {"step": 3} and not atomic.tmp_path(path).exists()


def test_sealed_file_is_plain_torch_and_verified(tmp_path):
    path = tmp_path / "x.pth"
    save_sealed(path, {"a": torch.arange(5)})
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(5))
    assert read_seal(path) is not None
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_sealed(path)


def test_restore_skips_only_named_parts():
    a, b = StepCounter(5), StepCounter(0)
    generator = torch.Generator().manual_seed(1)

    class GeneratorPart:
        def state_dict(self):
            return generator.get_state()

        def load_state_dict(self, state):
            generator.set_state(state)

    state = capture({"step": a, "gen_state": GeneratorPart()})
    torch.randint(0, 10, (3,), generator=generator)
    restore(state, {"step": b, "gen_state": GeneratorPart()}, skip={"gen_state"})
    assert b.value == 5
    assert not torch.equal(generator.get_state(), state["gen_state"])


def test_global_rng_round_trip():
    rng = GlobalRng()
    saved = rng.state_dict()
    expected = (torch.rand(3), np.random.rand(), random.random())
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.random.rand() == expected[1]
    assert random.random() == expected[2]


def test_run_identity_names_each_difference():
    identity = RunIdentity({"train": {"batch": 8, "lr": 0.003}, "data": "abc"})
    with pytest.raises(CheckpointError, match=r"data 'xyz' in file, 'abc' now; train\.batch 4 in file, 8 now"):
        identity.load_state_dict({"train": {"batch": 4, "lr": 0.003}, "data": "xyz"})
    identity.load_state_dict({"train": {"batch": 8, "lr": 0.003}, "data": "abc"})
