"""One writer per run folder: a second writer is refused naming the holder, waits with --wait-lock,
and a kill -9'd holder leaves no stale lock. The writer that runs ends bit-identical to an
uninterrupted run; readers take no lock.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from exactresume.errors import UserError
from exactresume.forkserver.client import Run
from exactresume.parts import GlobalRng
from exactresume.store.faults import FAULT_ENV
from exactresume.store.lock import HELD_ENV, LOCK_NAME, FolderLock, read_holder
from exactresume.store.numbered import CheckpointStore
from helpers import (
    SMALL,
    assert_one_line_error,
    assert_same_run,
    call_cli,
    printed,
    reference_run,
    run_cli,
    run_python,
    spawn_cli,
)

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def flags(folder: Path, data: Path, *extra: object) -> list[str]:
    return [
        str(arg)
        for arg in ("train", "--out", folder, "--data", data, *SMALL, "--save-every", 2, "--resume", "auto", *extra)
    ]


def start(args: list[str], env: dict[str, str] | None = None) -> Run:
    return spawn_cli(*args, env=ONE_THREAD | (env or {}))


def holding(folder: Path, process: Run) -> Run:
    """Wait until `process` holds the lock on `folder`, then freeze it there (SIGSTOP)."""
    deadline = time.monotonic() + 60
    while read_holder(folder / LOCK_NAME).get("pid") != process.pid:
        assert process.poll() is None and time.monotonic() < deadline, process.output()
        time.sleep(0.02)
    process.send_signal(signal.SIGSTOP)
    return process


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kjv_folder) -> Path:
    """The uninterrupted run, in this process on one thread (as the other exactness tests make it)."""
    return reference_run(tmp_path_factory, lambda out: flags(out, kjv_folder))


def test_second_writer_is_refused_naming_the_holder_and_the_first_ends_exact(tmp_path, kjv_folder, reference):
    folder = tmp_path / "run"
    first = holding(folder, start(flags(folder, kjv_folder)))
    try:
        second = run_cli(*flags(folder, kjv_folder), env=ONE_THREAD)
    finally:
        first.send_signal(signal.SIGCONT)
    assert_one_line_error(second, f"{folder} is being written by pid {first.pid} on host", "wait for it or stop it")
    assert first.wait(timeout=120) == 0, first.communicate()
    assert_same_run(folder, reference)


def test_wait_lock_takes_over_when_the_first_writer_stops(tmp_path, kjv_folder, reference):
    """The requeue case: the old job is stopped (SIGTERM) and the new one, waiting, resumes from its checkpoint."""
    folder = tmp_path / "run"
    first = holding(folder, start(flags(folder, kjv_folder)))
    second = start(flags(folder, kjv_folder, "--wait-lock", 120))
    try:
        assert "waiting up to 120 s" in printed(second, "waiting up to")  # it waits; it has written nothing
    finally:
        first.send_signal(signal.SIGTERM)
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=120) in (0, 75, -signal.SIGTERM)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "resumed from" in out or "starting at step 0" in out
    assert_same_run(folder, reference)


def frozen_after_its_second_checkpoint(folder: Path, data: Path) -> Run:
    """A first writer that trained 4 steps, saved them (step-00000004.pth, durable and verified) and was
    frozen there (SIGSTOP from inside the save), still holding the lock."""
    first = start(flags(folder, data), env={FAULT_ENV: "retention@2:stop"})
    deadline = time.monotonic() + 120
    while not _stopped(first.pid):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    assert CheckpointStore(folder / "checkpoints").checkpoints()[-1].step == 4
    return first


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("death", ["kill -9", "SIGTERM"])
def test_a_waiting_job_continues_from_the_dead_writers_last_checkpoint(tmp_path, kjv_folder, reference, death):
    """The requeue the README describes: the first writer trained and checkpointed, then died. While it holds
    the folder, another run given its OUT/checkpoints (`--checkpoints`) is refused too: that folder is locked
    by its own run, not only through OUT (such a run once resumed from it and pruned under the first)."""
    folder = tmp_path / "run"
    first = frozen_after_its_second_checkpoint(folder, kjv_folder)
    beside = call_cli(*flags(tmp_path / "other", kjv_folder, "--checkpoints", folder / "checkpoints"))
    assert_one_line_error(beside, f"{folder / 'checkpoints'} is being written by pid {first.pid}", "wait for it")
    second = start(flags(folder, kjv_folder, "--wait-lock", 120))
    try:
        assert "waiting up to 120 s" in printed(second, "waiting up to")  # it waits; it has written nothing
    finally:
        first.send_signal(signal.SIGKILL if death == "kill -9" else signal.SIGTERM)
        first.send_signal(signal.SIGCONT)
    # SIGTERM: the writer finishes the save it was in, saves the step it finished, and exits 75.
    assert first.wait(timeout=120) == (-signal.SIGKILL if death == "kill -9" else 75)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert f"resumed from {folder / 'checkpoints' / 'step-00000004.pth'} at step 4" in out
    assert_same_run(folder, reference)


def test_a_kill_9_holder_leaves_no_stale_lock(tmp_path, kjv_folder, reference):
    folder = tmp_path / "run"
    first = holding(folder, start(flags(folder, kjv_folder)))
    first.kill()
    first.wait()
    assert read_holder(folder / LOCK_NAME).get("pid") == first.pid  # its note is left; its lock is not
    second = run_cli(*flags(folder, kjv_folder), env=ONE_THREAD)
    assert second.returncode == 0, second.stderr
    assert_same_run(folder, reference)


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])


def test_a_second_checkpoint_store_is_refused_in_this_process_and_another(tmp_path):
    folder = tmp_path / "checkpoints"
    first = CheckpointStore(folder)
    first.save(1, {"count": Counter(1), "rng": GlobalRng()})
    second = CheckpointStore(folder)
    with pytest.raises(
        UserError,
        match=f"is being written by pid {os.getpid()} \\(this process: another store of it on the folder, to close",
    ):
        second.save(2, {"count": Counter(2)})
    with pytest.raises(UserError, match="being written"):
        second.load({"count": Counter()})  # a load cleans up: a writer's act
    restored = Counter()
    assert second.load({"count": restored}, skip=["rng"], clean=False) == 1 and restored.value == 1  # no lock
    assert [c.step for c in second.checkpoints()] == [1]
    script = (
        "import sys; from exactresume.store.numbered import CheckpointStore;"
        f"CheckpointStore({str(folder)!r}).save(2, {{}})"
    )
    (tmp_path / "other.py").write_text(script)
    other = run_python(tmp_path / "other.py", env=ONE_THREAD)
    assert other.returncode == 1 and f"being written by pid {os.getpid()} on host" in other.stderr
    first.close()
    assert not (folder / LOCK_NAME).exists()
    with CheckpointStore(folder) as third:
        third.save(2, {"count": Counter(2)})
    restored = Counter()
    assert CheckpointStore(folder).load({"count": restored}) == 2 and restored.value == 2


def test_a_refusal_in_the_moment_the_holder_writes_its_note_still_names_it(tmp_path):
    """The holder takes the lock, then writes who it is; a refusal in between waits for the note."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, and still empty
    note = threading.Timer(0.05, lambda: os.pwrite(fd, b'{"pid": 4242, "host": "h", "since": 0}\n', 0))
    note.start()
    with pytest.raises(UserError, match="is being written by pid 4242 on host h"):
        FolderLock.acquire(folder)
    note.join()
    os.close(fd)


def test_a_holder_letting_go_while_a_refusal_looks_is_no_refusal(tmp_path):
    """The holder unlocks and deletes its file between another's try and its look at who holds it: the
    lock is free, and taken."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def let_go() -> None:
        (folder / LOCK_NAME).unlink()
        os.close(fd)

    timer = threading.Timer(0.05, let_go)
    timer.start()
    lock = FolderLock.acquire(folder)
    timer.join()
    assert lock.held and read_holder(folder / LOCK_NAME)["pid"] == os.getpid()
    lock.release()


def test_lab_and_ablate_are_refused_while_the_folder_is_written(tmp_path, kjv_folder):
    with FolderLock.acquire(tmp_path):
        for command in ("lab", "ablate"):
            finished = call_cli(command, "--out", tmp_path, "--data", kjv_folder, *SMALL, "--stop-at", 4)
            assert_one_line_error(finished, f"{tmp_path} is being written by pid {os.getpid()}")


def test_a_child_writes_under_its_parents_lock_and_nobody_else_does(tmp_path, monkeypatch):
    monkeypatch.delenv(HELD_ENV, raising=False)
    lock = FolderLock.acquire(tmp_path)
    lock.share_with_children()
    script = "from exactresume.store.lock import FolderLock; import sys; FolderLock.acquire(sys.argv[1])"
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    lock.release()
    assert HELD_ENV not in os.environ  # the environment as it was (the processes started later share it)
    stranger = FolderLock.acquire(tmp_path)  # a stale token in the environment lets no one in
    monkeypatch.setenv(HELD_ENV, lock.token)
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert child.returncode == 1 and "being written by pid" in child.stderr
    stranger.release()


def test_readers_take_no_lock(tmp_path, kjv_folder, reference):
    with FolderLock.acquire(reference):
        assert call_cli("inspect", reference / "checkpoints" / "step-00000008.pth").returncode == 0
        assert call_cli("diff", reference / "final.pth", reference / "final.pth").returncode == 0


def test_under_many_processes_rank_0_takes_the_lock(tmp_path, kjv_folder):
    """--nproc 2 into a folder being written: rank 0 is refused, and the launcher says so in one line."""
    with FolderLock.acquire(tmp_path):
        finished = run_cli(*flags(tmp_path, kjv_folder, "--nproc", 2, "--quiet"), env=ONE_THREAD)
    assert_one_line_error(finished, f"{tmp_path} is being written by pid {os.getpid()}")
    assert not (tmp_path / "checkpoints").exists()


def test_wait_lock_without_auto_resume_is_refused(tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path / "run", "--data", kjv_folder, *SMALL, "--wait-lock", 5)
    assert_one_line_error(finished, "--wait-lock needs --resume auto")
    assert not (tmp_path / "run").exists()
