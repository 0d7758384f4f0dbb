"""The doctor moves the run's own files only: never /dev/null, a FIFO, or a cache in the temp folder.

A script that writes to /dev/null (a logger, a child's stdout=DEVNULL) once had /dev/null moved aside
and put back as an empty regular file: run as root, the machine had no null device after the doctor.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from exactresume.cli import main
from exactresume.doctor.files import Ledger, originals, put_back, roots, set_aside
from exactresume.doctor.run import Process, TracedRun
from exactresume.doctor.tracer.files import Files
from helpers import assert_one_line_error, call_cli, stable_environ

SCRIPT = Path(__file__).parent / "doctor_scripts" / "system_files.py"


def traced(wrote: dict[str, bool], kept: dict[str, str] = (), saves: list[str] = ()) -> TracedRun:
    """A run as the doctor reads it from its traces: the paths it wrote, the copies kept, its saves."""
    run = TracedRun("straight", [], 0, 0.0, Path("log"), None, wrote=dict(wrote), kept=dict(kept))
    run.processes = [Process(1, saves=[{"path": path, "step": 2} for path in saves])]
    return run


@pytest.fixture
def temp(tmp_path, monkeypatch) -> Path:
    """A temp folder of the test's own (tempfile.gettempdir() answers it), the working folder outside it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "temp"


def test_devices_fifos_and_temporary_caches_are_not_the_runs(temp, tmp_path):
    work = tmp_path / "work"
    for folder in ("torchinductor_root/fxgraph", "pymp-abc", "cache/entries", "tmpxyz", "run/ckpt"):
        (temp / folder).mkdir(parents=True)
    os.mkfifo(work / "pipe")
    os.symlink(os.devnull, work / "log")
    (work / "ckpt").mkdir()
    paths = {
        os.devnull: False,
        str(work / "pipe"): False,
        str(work / "log"): False,
        str(temp / "torchinductor_root"): True,
        str(temp / "torchinductor_root" / "fxgraph"): True,
        str(temp / "pymp-abc"): True,
        str(temp / "cache" / "entries"): True,
        str(temp / "tmpxyz"): True,  # mkdtemp's folder, with a checkpoint in it: the resume reads it
        str(temp / "run" / "ckpt"): True,  # a checkpoint folder in the temp folder
        str(work / "ckpt"): True,
    }
    saves = [str(temp / "tmpxyz" / "resume.pt"), str(temp / "run" / "ckpt" / "resume.pt"), str(work / "ckpt" / "a.pt")]
    run = traced(paths, saves=saves)
    assert set(roots([run])) == {str(work / "ckpt"), str(temp / "tmpxyz"), str(temp / "run" / "ckpt")}
    kept = {os.devnull: "copy", str(work / "pipe"): "copy", str(temp / "cache" / "old"): "copy"}
    assert originals([traced({}, kept)]) == {}
    ours = {str(work / "notes.txt"): "copy"}
    assert originals([traced({}, kept | ours)]) == ours


def test_a_working_folder_in_the_temp_folder_is_the_users(temp, monkeypatch):
    (temp / "notebook" / "logs").mkdir(parents=True)
    (temp / "notebook" / "tmpcache").mkdir()
    (temp / "elsewhere").mkdir()
    monkeypatch.chdir(temp / "notebook")
    paths = {str(temp / "notebook" / "logs"): True, str(temp / "notebook" / "tmpcache"): True}
    run = traced(paths | {str(temp / "elsewhere"): True})
    assert roots([run]) == [str(temp / "notebook" / "logs"), str(temp / "notebook" / "tmpcache")]


def test_the_tracer_reports_and_copies_no_device_and_no_fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "folder" / "pipe")
    (tmp_path / "folder" / "a.txt").write_text("a")
    (tmp_path / "notes.txt").write_text("before")
    events: list[dict] = []
    files = Files(events.append, str(tmp_path / "keep"), str(tmp_path / "out"))
    for path in (os.devnull, "/dev/stdout", "/proc/self/status", tmp_path / "pipe", tmp_path / "notes.txt"):
        files.before_write(path)  # a FIFO once raised SpecialFileError in the user's script here
    files.before_delete(tmp_path / "folder")
    assert [(e["event"], e["path"]) for e in events if e["event"] == "wrote"] == [
        ("wrote", str(tmp_path / "notes.txt")),
        ("wrote", str(tmp_path / "folder")),
    ]
    copy = {e["path"]: Path(e["copy"]) for e in events if e["event"] == "kept"}[str(tmp_path / "folder")]
    assert sorted(p.name for p in copy.iterdir()) == ["a.txt"]  # the FIFO in it is left out of the copy


@pytest.fixture
def null_device():
    """/dev/null's device numbers; should the doctor ever replace it again, it is made again as root."""
    before = os.stat(os.devnull)
    yield before
    after = os.lstat(os.devnull)
    if not stat.S_ISCHR(after.st_mode) and os.geteuid() == 0:
        os.unlink(os.devnull)
        os.mknod(os.devnull, stat.S_IFCHR | 0o666, before.st_rdev)
        os.chmod(os.devnull, 0o666)


def test_the_doctor_leaves_dev_null_a_fifo_and_a_temp_cache_where_they_are(tmp_path, null_device):
    cache = Path(tempfile.mkdtemp(prefix="exactresume-cache-"))
    try:
        (cache / "mine.txt").write_text("the user's")
        command = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "ckpt")]
        command += ["--cache", str(cache), "--fifo", str(tmp_path / "pipe")]
        flags = ["--steps", "8", "--stop-after", "4", "--out", str(tmp_path / "doctor"), "--resume-args=--resume"]
        with stable_environ():
            code = main(["doctor", "--warm", *flags, "--", *command])
        after = os.stat(os.devnull)
        assert stat.S_ISCHR(after.st_mode) and after.st_rdev == null_device.st_rdev
        assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode)
        assert code == 0 and "bit-identical" in (tmp_path / "doctor" / "verdict.txt").read_text()
        contents = {str(p.relative_to(cache)): p.read_bytes() for p in cache.rglob("*") if p.is_file()}
        assert contents == {"mine.txt": b"the user's", "entries/kernel.bin": b"compiled once"}
        moves = json.loads((tmp_path / "doctor" / "files" / "moves.json").read_text())
        assert {move["from"] for move in moves} == {
            str(tmp_path / "ckpt"),
            str(tmp_path / "doctor/files/straight/000-ckpt"),
        }
    finally:
        shutil.rmtree(cache)


SLOW_SCRIPT = """
import os, sys, time, torch
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
os.makedirs(sys.argv[1], exist_ok=True)
for step in range(600):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save(model.state_dict(), os.path.join(sys.argv[1], "last.pt"))
    time.sleep(0.05)
"""


def test_a_file_the_straight_run_added_to_a_folder_of_yours_is_not_put_back_into_it(tmp_path, monkeypatch):
    """A checkpoint folder of the user's own run that the straight run wrote into (a rank file of its own
    beside the user's weights) gets back the user's files only: mixed, a later resume of it would read the
    doctor's run's file with the user's weights. A folder the straight run made comes back whole."""
    monkeypatch.chdir(tmp_path)
    yours, made, out = tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-4", tmp_path / "doctor"
    for folder in (yours, made, out / "files" / "before"):
        folder.mkdir(parents=True)
    (out / "files" / "before" / "model.pt").write_text("yours")
    (yours / "model.pt").write_text("the straight run's")
    (yours / "rank0.pt").write_text("added by the straight run")
    (made / "model.pt").write_text("made by the straight run")
    wrote = {yours / "model.pt": False, yours / "rank0.pt": True, made: True, made / "model.pt": True}
    kept = {str(yours / "model.pt"): str(out / "files" / "before" / "model.pt")}
    run = traced(
        {str(path): new for path, new in wrote.items()}, kept, [str(yours / "model.pt"), str(made / "model.pt")]
    )
    ledger = Ledger(out)
    put_back(ledger, run, set_aside(ledger, run), [])
    assert os.listdir(yours) == ["model.pt"] and (yours / "model.pt").read_text() == "yours"
    assert os.listdir(made) == ["model.pt"] and (made / "model.pt").read_text() == "made by the straight run"


def test_a_put_back_cut_short_is_finished_without_moving_what_it_had_put_back(tmp_path, monkeypatch):
    """A doctor stopped halfway through putting back: the next one's recovery leaves the originals it
    had put back where they are (their copies are gone), and finishes the rest."""
    monkeypatch.chdir(tmp_path)
    user, out = tmp_path / "ckpt", tmp_path / "doctor"
    user.mkdir()
    (out / "files" / "before").mkdir(parents=True)
    for name in ("a.pt", "b.pt"):
        (user / name).write_text(f"the user's {name}")
    (out / "files" / "before" / "b.pt").write_text("the user's b.pt")  # a.pt's copy: put back already
    (user / "b.pt").write_text("the run's")
    (user / "new.pt").write_text("made by the run")
    run = traced(
        {str(user / n): n == "new.pt" for n in ("a.pt", "b.pt", "new.pt")},
        {
            str(user / "a.pt"): str(out / "files" / "before" / "a.pt"),
            str(user / "b.pt"): str(out / "files" / "before" / "b.pt"),
        },
        saves=[str(user / "new.pt")],
    )
    put_back(Ledger(out), run, [], [run], into="stopped")
    assert {p.name: p.read_text() for p in user.iterdir()} == {"a.pt": "the user's a.pt", "b.pt": "the user's b.pt"}
    assert sorted(p.read_text() for p in (out / "files" / "stopped").iterdir()) == ["made by the run", "the run's"]


def test_a_killed_doctor_leaves_no_run_writing_into_the_users_folder(tmp_path):
    """kill -9 of the doctor: the run it started ends at its next step (exit code CUT), rather than train on
    and write over the user's checkpoint after the doctor that would have put it back is gone; the next
    doctor into the same folder puts back what it had changed before it runs, from its traces."""
    import signal
    import subprocess
    import time

    from exactresume.doctor.tracer import CUT

    script = tmp_path / "slow.py"
    script.write_text(SLOW_SCRIPT)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.pt").write_text("the user's own")
    command = [sys.executable, "-m", "exactresume.cli", "doctor", "--steps", "400", "--stop-after", "200"]
    command += ["--out", str(tmp_path / "doctor"), "--", sys.executable, str(script), str(tmp_path / "ckpt")]
    doctor = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    traces = tmp_path / "doctor" / "traces"
    deadline = time.monotonic() + 60
    while not list(traces.rglob("trace-*.jsonl")) or '"step"' not in next(traces.rglob("trace-*.jsonl")).read_text():
        assert time.monotonic() < deadline and doctor.poll() is None, "the straight run never stepped"
        time.sleep(0.2)
    doctor.send_signal(signal.SIGKILL)
    doctor.wait()
    (trace,) = traces.rglob("trace-*.jsonl")
    deadline = time.monotonic() + 20
    while '"event": "end"' not in trace.read_text():
        assert time.monotonic() < deadline, "the run went on after the doctor was killed"
        time.sleep(0.2)
    ended = [json.loads(line) for line in trace.read_text().splitlines() if '"event": "end"' in line]
    assert ended[0]["code"] == CUT and ended[0]["steps"] < 400
    assert (tmp_path / "ckpt" / "last.pt").read_bytes().startswith(b"PK")  # the killed run's, not the user's
    args = ["--steps", "4", "--stop-after", "2", "--out", tmp_path / "doctor", "--warm"]
    again = call_cli("doctor", *args, "--", sys.executable, script, tmp_path / "ckpt")
    assert (
        "doctor: a doctor into" in again.stdout and "1 path(s) its runs had moved or changed are back" in again.stdout
    )
    assert_one_line_error(again, "the resumed run started at step 0")  # the slow script cannot resume
    assert (tmp_path / "ckpt" / "last.pt").read_text() == "the user's own"
