"""`exactresume train --save-every N --resume auto` through kill -9, full disks, bad files and preemption.

Every exactness claim compares a run interrupted in new processes with one uninterrupted run:
every tensor `torch.equal`, the loss and samples logs equal byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exactresume.forkserver.client import Run
from exactresume.store.faults import FAULT_ENV, STAGES
from exactresume.store.layout import checkpoint_name
from exactresume.store.numbered import CheckpointStore
from exactresume.store.sealed import save_sealed, verify
from exactresume.store.weights import read_weights
from helpers import (
    SMALL,
    assert_one_line_error,
    assert_same_run,
    call_cli,
    one_torch_thread,
    reference_run,
    run_cli,
    run_python,
    spawn_cli,
)

# One thread per process: the runs compared are made alike, and far faster on a shared 2-core machine.
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True)
def one_thread():
    """In-process runs (refusals, injected errors) on one thread too, for speed."""
    with one_torch_thread():
        yield


# The default model: its 20 MB checkpoints are what the full disk (30 MB) and the file-size limit are sized for.
DEFAULT_MODEL = ["--preset", "default"]


def train_flags(folder: Path, data: Path, *extra: object) -> list:
    flags = [*SMALL, *DEFAULT_MODEL, "--samples", folder / "samples.csv"]
    return ["train", "--out", folder, "--data", data, *flags, *extra]


def chaos_flags(folder: Path, data: Path) -> list:
    return train_flags(folder, data, "--save-every", 2, "--keep", 2, "--resume", "auto")


def run_child(args, fault: str | None = None) -> subprocess.CompletedProcess:
    """The CLI in a new process, on one thread, with `fault` injected: its exit code (-9 when killed)."""
    return run_cli(*args, env={"OMP_NUM_THREADS": "1"} | ({FAULT_ENV: fault} if fault else {}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kjv_folder) -> Path:
    """The uninterrupted run, checkpointing as the interrupted ones do (in this process, on one thread)."""
    return reference_run(tmp_path_factory, lambda out: chaos_flags(out, kjv_folder))


def checkpoint_files(folder: Path) -> tuple[list[int], list[str]]:
    """(steps of the checkpoints, names of .tmp leftovers); every checkpoint must verify."""
    store = CheckpointStore(folder / "checkpoints")
    for checkpoint in store.checkpoints():
        verify(checkpoint.path)
    return [c.step for c in store.checkpoints()], [p.name for p in store.leftovers()]


def logged_steps(folder: Path) -> int:
    try:
        return len((folder / "log.csv").read_text().splitlines()) - 1
    except FileNotFoundError:
        return 0


def assert_storage_error(finished: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 74, exactly one line on stderr, no traceback, and it mentions each needle."""
    assert finished.returncode == 74, finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in finished.stderr, finished.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".tmp")
    }


# -- kill -9 ------------------------------------------------------------------------------------------

# (fault, checkpoint steps after the kill, .tmp left behind) for 8 steps saved every 2, keeping 2: one
# kill at every stage of a save, each run resuming from what the one before it left.
STAGE_KILLS = [
    ("snapshot@2", [2], []),  # step 4's state not yet taken
    ("write@1", [2], ["step-00000004.pth.tmp"]),  # half the bytes written
    ("fsync@1", [2], ["step-00000004.pth.tmp"]),  # all bytes written, not fsynced
    ("rename@1", [2], ["step-00000004.pth.tmp"]),  # written and fsynced, not renamed
    ("folder-fsync@1", [2, 4], []),  # renamed, folder not fsynced
    ("retention@1", [2, 4, 6], []),  # verified, older not yet pruned
    ("verify@1", [2, 4, 6, 8], []),  # renamed and durable, not yet read back
]


def test_the_stage_kills_cover_every_stage():
    assert sorted(fault.split("@")[0] for fault, _, _ in STAGE_KILLS) == sorted(STAGES)


@pytest.mark.parametrize("writer", [[], ["--async-save"]], ids=["sync", "async"])
def test_kills_inside_each_save_stage_then_auto_resume_is_bit_exact(tmp_path, kjv_folder, reference, writer):
    """With --async-save the kills after the snapshot land in the background writer while the loop trains on."""
    folder = tmp_path / "run"
    for fault, steps, leftovers in STAGE_KILLS:
        finished = run_child(chaos_flags(folder, kjv_folder) + writer, fault=fault)
        assert finished.returncode == -signal.SIGKILL, (fault, finished.stderr)
        found, left = checkpoint_files(folder)
        # In the background the next save is written while this one is read back and pruned: a kill there
        # may cut that one too, leaving its .tmp (which the next run removes, as any).
        after_publishing = writer and fault.startswith(("retention", "verify"))
        racing = {checkpoint_name(steps[-1] + 2) + ".tmp"} if after_publishing else set()
        assert found == steps and set(left) - racing == set(leftovers), fault
        assert not (folder / "final.pth").exists(), fault
    # The newest checkpoint damaged after the last kill: auto-resume says so and uses the one before.
    newest = folder / "checkpoints" / checkpoint_name(8)
    data = newest.read_bytes()
    newest.write_bytes(data[:5000] + bytes([data[5000] ^ 0x10]) + data[5001:])
    finished = run_child(chaos_flags(folder, kjv_folder) + writer)
    assert finished.returncode == 0, finished.stderr
    assert re.search(r"skipping damaged checkpoint .*step-00000008\.pth: checksum mismatch", finished.stderr)
    assert f"resumed from {folder / 'checkpoints' / checkpoint_name(6)} at step 6" in finished.stdout
    assert checkpoint_files(folder) == ([6, 8], [])
    assert_same_run(folder, reference)


# -- preemption and a kill at a random moment ---------------------------------------------------------


def start_child(args) -> Run:
    return spawn_cli(*args, env={"OMP_NUM_THREADS": "1"})


def wait_for_a_new_step(child: Run, folder: Path, after: int) -> None:
    while logged_steps(folder) <= after and child.poll() is None:
        time.sleep(0.002)


def kill_at_a_random_moment(folder: Path, data: Path, after: int, tries: int = 6) -> None:
    """SIGKILL a resumed run at a random moment after its next step: inside a step, a save, or between them.

    A run that ended before the kill proves nothing: its folder is put back and the kill tried again, sooner.
    """
    before = folder.with_name(folder.name + ".before")
    shutil.copytree(folder, before)
    for attempt in range(tries):
        child = start_child(chaos_flags(folder, data))
        wait_for_a_new_step(child, folder, after=after)
        time.sleep(random.uniform(0.0, 0.3) / 2**attempt)
        child.kill()
        child.communicate()
        if child.returncode == -signal.SIGKILL:
            return
        shutil.rmtree(folder)
        shutil.copytree(before, folder)
    pytest.fail(f"the run ended before the kill {tries} times: no kill was tested")


def test_sigterm_saves_then_kill_at_random_then_auto_resume_is_bit_exact(tmp_path, kjv_folder, reference):
    folder = tmp_path / "run"
    # Without --save-every: the only checkpoint is the one preemption writes.
    child = start_child(train_flags(folder, kjv_folder, "--resume", "auto"))
    wait_for_a_new_step(child, folder, after=0)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate()
    assert child.returncode == 75, f"exit {child.returncode} (did the run end before the signal?): {stderr}"
    match = re.search(r"stopped by SIGTERM after step (\d+); saved (\S+), continue with --resume auto", stderr)
    assert match, stderr
    stopped = int(match.group(1))
    assert Path(match.group(2)) == folder / "checkpoints" / checkpoint_name(stopped)
    assert checkpoint_files(folder) == ([stopped], []) and logged_steps(folder) == stopped
    kill_at_a_random_moment(folder, kjv_folder, after=stopped)
    checkpoint_files(folder)  # whatever it had written verifies
    finished = run_child(chaos_flags(folder, kjv_folder))
    assert finished.returncode == 0, finished.stderr
    assert_same_run(folder, reference)


def test_sigint_finishes_the_step_and_saves(tmp_path, kjv_folder, monkeypatch):
    from exactresume.cli import build_parser
    from exactresume.commands import train
    from exactresume.training.joblog import RunLogs

    logged = RunLogs.record

    def interrupted_at_step_3(logs, record):
        logged(logs, record)
        if record.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-loop, as Ctrl-C would

    monkeypatch.setattr(RunLogs, "record", interrupted_at_step_3)
    args = build_parser().parse_args(list(map(str, train_flags(tmp_path, kjv_folder, "--resume", "auto"))))
    assert train.run(args) == 75
    assert checkpoint_files(tmp_path) == ([3], []) and logged_steps(tmp_path) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


# -- full disk --------------------------------------------------------------------------------------


def test_a_write_the_kernel_refuses_stops_with_nothing_half_written_then_resumes(tmp_path, kjv_folder, reference):
    """The full-disk path without root: a file-size limit (RLIMIT_FSIZE) makes the kernel itself refuse a
    checkpoint's write halfway through (EFBIG), and the run meets it as it meets a full disk."""
    folder = tmp_path / "run"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, hard))  # a checkpoint (about 20 MB) cannot be written
    try:  # a refusal: in this process (Python ignores SIGXFSZ, so the write fails with EFBIG), on one thread
        with one_torch_thread():
            finished = call_cli(*chaos_flags(folder, kjv_folder))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert_storage_error(finished, "File too large (EFBIG)", "step 2", "no earlier checkpoint exists", "ulimit -f")
    assert checkpoint_files(folder) == ([], [])  # the half-written file is gone, nothing else was written
    finished = run_child(chaos_flags(folder, kjv_folder))  # the limit lifted
    assert finished.returncode == 0, finished.stderr
    assert_same_run(folder, reference)


def test_full_disk_stops_with_previous_checkpoint_intact_then_resumes(small_disk, kjv_folder, reference):
    folder = small_disk / "run"
    # --force past the disk check before the first checkpoint (test_plan.py): the disk fills mid-run.
    finished = call_cli(*chaos_flags(folder, kjv_folder), "--force")  # a refusal: in this process, on one thread
    assert_storage_error(finished, "No space left on device", "step 4", "step-00000002.pth is intact", "free space")
    assert checkpoint_files(folder) == ([2], [])
    assert not (folder / "final.pth").exists()
    subprocess.run(["mount", "-o", "remount,size=100m", str(small_disk)], check=True)  # space freed
    finished = run_child(chaos_flags(folder, kjv_folder))
    assert finished.returncode == 0, finished.stderr
    assert_same_run(folder, reference)


@pytest.mark.parametrize("stage", ["write", "fsync", "rename", "folder-fsync", "verify"])
@pytest.mark.parametrize("error", ["enospc", "eio"])
def test_io_error_at_each_save_stage_stops_cleanly(tmp_path, kjv_folder, monkeypatch, stage, error):
    monkeypatch.setenv(FAULT_ENV, f"{stage}@2:{error}")
    finished = call_cli(*chaos_flags(tmp_path, kjv_folder))
    assert_storage_error(
        finished, "checkpoint at step 4", "ENOSPC" if error == "enospc" else "EIO", "step-00000002.pth is intact"
    )
    assert ("free space" in finished.stderr) == (error == "enospc")  # the advice follows the cause
    assert checkpoint_files(tmp_path) == ([2], [])
    assert not (tmp_path / "final.pth").exists()


# -- bad inputs: exit 2, one line, nothing overwritten -----------------------------------------------


@pytest.fixture
def victim(tmp_path) -> Path:
    """An output folder holding files a refused command must not touch."""
    folder = tmp_path / "victim"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "log.csv").write_text("step,train_loss\n1,1.000000\n")
    torch.save({"weights": torch.ones(2)}, folder / "final.pth")  # an earlier run's, as a resume finds it
    return folder


def damaged(good: bytes, damage: str) -> bytes:
    kind, _, where = damage.partition(":")
    offset = {
        "1": 1,
        "100": 100,
        "4096": 4096,
        "half": len(good) // 2,
        "end-1": len(good) - 1,
        "end-30": len(good) - 30,
        "end-10": len(good) - 10,
    }.get(where, 0)
    if kind == "truncate":
        return good[:offset]
    if kind == "flip":
        return good[:offset] + bytes([good[offset] ^ 0x01]) + good[offset + 1 :]
    return {"empty": b"", "random": random.Random(3).randbytes(100_000)}[kind]


@pytest.mark.parametrize(
    "damage, reason",
    [
        *[(f"truncate:{where}", "truncated") for where in ("1", "100", "4096", "half", "end-30", "end-1")],
        *[(f"flip:{where}", "checksum mismatch") for where in ("100", "half", "end-10")],
        ("empty", "empty"),
        ("random", "truncated, or not written by exactresume"),
    ],
)
def test_damaged_checkpoint_is_refused(tmp_path, kjv_folder, reference, victim, damage, reason):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(damaged((reference / "checkpoints" / checkpoint_name(8)).read_bytes(), damage))
    before, bad_bytes = tree(victim), bad.read_bytes()
    finished = call_cli(*train_flags(victim, kjv_folder, "--save-every", 2, "--resume", bad))
    assert_one_line_error(finished, str(bad), reason)
    assert tree(victim) == before and bad.read_bytes() == bad_bytes


def test_foreign_files_are_refused(tmp_path, kjv_folder, reference, victim):
    state = read_weights(reference / "final.pth")[0]
    save_file({name: tensor.clone() for name, tensor in state.items()}, tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "plain.pth")
    before = tree(victim)
    for path, reason in (
        (tmp_path / "model.safetensors", "no exactresume checksum"),
        (tmp_path / "plain.pth", "no exactresume checksum"),
        (reference / "final.pth", "weights file, not a resume file"),
    ):
        finished = call_cli(*train_flags(victim, kjv_folder, "--resume", path))
        assert_one_line_error(finished, str(path), reason)
    assert tree(victim) == before


def test_sealed_pickle_payload_does_not_run(tmp_path, kjv_folder, victim):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = victim / "checkpoints" / checkpoint_name(6)
    save_sealed(evil, {"format": "exactresume.resume", "payload": Payload()})  # its checksum is right
    before = tree(victim)
    assert_one_line_error(
        call_cli(*train_flags(tmp_path / "out", kjv_folder, "--resume", evil)), str(evil), "not a loadable"
    )
    assert_one_line_error(
        call_cli(*train_flags(tmp_path / "out", kjv_folder, "--resume", evil.parent)),
        str(evil.parent),
        "holds no complete checkpoint",
        "not a loadable",
    )
    assert tree(victim) == before
    # Its own folder's only checkpoint: refused too, rather than a fresh start that would train over it.
    finished = call_cli(*train_flags(victim, kjv_folder, "--resume", "auto", "--stop-at", 1))
    assert_one_line_error(finished, str(evil.parent), checkpoint_name(6), "not a loadable", "move the checkpoints out")
    assert tree(victim) == before
    assert not marker.exists()


def test_auto_resume_over_a_folder_whose_every_checkpoint_is_damaged_stops_rather_than_start_at_step_0(
    tmp_path, kjv_folder, reference
):
    out = tmp_path / "out"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    for path in (out / "checkpoints").glob("step-*.pth"):
        path.write_bytes(damaged(path.read_bytes(), "flip:half"))
    before = tree(out)
    finished = call_cli(*chaos_flags(out, kjv_folder))
    assert_one_line_error(finished, str(out / "checkpoints"), "checksum mismatch", "move the checkpoints out")
    assert tree(out) == before  # no step trained, no log row, no checkpoint written or set aside


def test_folder_of_only_tmp_leftovers(tmp_path, kjv_folder, victim):
    leftover = victim / "checkpoints" / "step-00000004.pth.tmp"
    leftover.write_bytes(b"half a checkpoint")
    finished = call_cli(*train_flags(tmp_path / "out", kjv_folder, "--resume", victim / "checkpoints"))
    assert_one_line_error(finished, "holds no complete checkpoint", "1 .tmp leftover")
    assert leftover.exists()  # someone else's folder: nothing deleted
    finished = call_cli(*train_flags(victim, kjv_folder, "--resume", "auto", "--stop-at", 1))
    assert finished.returncode == 0, finished.stderr
    assert "no checkpoint in" in finished.stdout and not leftover.exists()  # our own store: cleaned, fresh start


def test_different_run_is_refused_naming_each_field(tmp_path, kjv_folder, reference, victim):
    newest = reference / "checkpoints" / checkpoint_name(8)
    before = tree(victim)
    finished = call_cli(*train_flags(victim, kjv_folder, "--resume", newest, "--steps", 12, "--lr", 0.001))
    assert_one_line_error(
        finished, "different run", "train.lr 0.003 in file, 0.001 now", "train.steps 8 in file, 12 now"
    )
    assert tree(victim) == before
    (victim / "checkpoints" / checkpoint_name(8)).write_bytes(newest.read_bytes())
    before = tree(victim)
    finished = call_cli(*train_flags(victim, kjv_folder, "--resume", "auto", "--batch", 3))
    assert_one_line_error(finished, "different run", "train.batch 2 in file, 3 now")
    assert tree(victim) == before


def test_allow_change_extends_steps_on_purpose(tmp_path, kjv_folder, reference):
    newest = reference / "checkpoints" / checkpoint_name(8)
    finished = call_cli(
        *train_flags(
            tmp_path, kjv_folder, "--resume", newest, "--steps", 12, "--allow-change", "steps", "--save-every", 4
        )
    )
    assert finished.returncode == 0, finished.stderr
    assert (
        "train.steps 8 in file, 12 now" in finished.stdout
        and "lr at step 8 was 0.0003 on the old schedule" in finished.stdout
    )
    assert [line.split(",")[0] for line in (tmp_path / "log.csv").read_text().splitlines()[1:]] == [
        "9",
        "10",
        "11",
        "12",
    ]
    newest = torch.load(tmp_path / "checkpoints" / checkpoint_name(12), weights_only=True)
    assert newest["config"]["train"]["steps"] == 12
    assert_one_line_error(
        call_cli(*train_flags(tmp_path, kjv_folder, "--allow-change", "hidden_size")), "--allow-change hidden_size"
    )


def test_unwritable_output_folders(tmp_path, kjv_folder):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert_one_line_error(call_cli(*train_flags(blocker / "out", kjv_folder, "--save-every", 2)), "a-file")
    (tmp_path / "out" / "checkpoints").parent.mkdir()
    (tmp_path / "out" / "checkpoints").write_text("a file where the checkpoint folder goes")
    assert_one_line_error(call_cli(*train_flags(tmp_path / "out", kjv_folder, "--save-every", 2)), "checkpoints")
    finished = call_cli(*train_flags(tmp_path / "ok", kjv_folder, "--log", blocker / "log.csv"))
    assert_one_line_error(finished, "a-file")
    # /sys is read-only even for root, which chmod would not stop.
    assert_one_line_error(
        call_cli(*train_flags(Path("/sys/exactresume-test"), kjv_folder, "--save-every", 2)), "/sys/exactresume-test"
    )


# -- the README's library example -----------------------------------------------------------------


def readme_library_example() -> str:
    block = README.read_text().split("<!-- own-loop:begin -->", 1)[1].split("<!-- own-loop:end -->", 1)[0]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_library_example_survives_a_kill_mid_save(tmp_path, monkeypatch):
    script = tmp_path / "example.py"
    script.write_text(readme_library_example())
    killed = run_python(script, tmp_path / "killed", env={"OMP_NUM_THREADS": "1", FAULT_ENV: "write@3"})
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "killed" / "checkpoints" / "step-00000030.pth.tmp").exists()
    resumed = run_python(script, tmp_path / "killed", env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0 and "trained steps 21 to 40" in resumed.stdout, resumed.stdout
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "straight")])
    runpy.run_path(str(script), run_name="__main__")  # the uninterrupted run, in this process
    a, b = torch.load(tmp_path / "straight" / "final.pt"), torch.load(tmp_path / "killed" / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
