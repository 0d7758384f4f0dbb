"""A second signal acts at once: SIGINT twice exits 130 and saves nothing, between steps or mid-save;
SIGTERM twice ends the process as SIGTERM does, with nothing more saved.

The README: "SIGTERM or SIGINT lets the current step finish, saves a checkpoint of it, and exits with
code 75 ... A second signal acts at once (SIGINT: exit 130, no save)." The signals are sent from
inside the run (after a step, or when the preemption save reaches its write stage), so where they
land is certain; the run is in this process, on one thread.
"""

from __future__ import annotations

import os
import signal

import pytest

from exactresume.store.faults import FaultPoints
from exactresume.store.numbered import CheckpointStore
from exactresume.training.joblog import RunLogs
from helpers import SMALL, call_cli, one_torch_thread, run_python


@pytest.fixture(autouse=True)
def one_thread():
    with one_torch_thread():
        yield


def interrupt_after_step(monkeypatch, step: int, times: int) -> None:
    """Send SIGINT `times` times right after `step`, as Ctrl-C pressed during the step would."""
    logged = RunLogs.record

    def logged_then_interrupted(logs, record):  # the step is done and logged, not yet checked for a signal
        logged(logs, record)
        if record.step == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(RunLogs, "record", logged_then_interrupted)


def interrupt_when_a_save_writes(monkeypatch) -> list[str]:
    """Send SIGINT each time a save reaches its write stage; returns the stages reached, for the test."""
    reached = FaultPoints.reached
    stages: list[str] = []

    def reached_then_interrupt(self, stage):
        stages.append(stage)
        if stage == "write":
            os.kill(os.getpid(), signal.SIGINT)
        return reached(self, stage)

    monkeypatch.setattr(FaultPoints, "reached", reached_then_interrupt)
    return stages


def assert_nothing_saved(folder, steps_logged: int) -> None:
    store = CheckpointStore(folder / "checkpoints")
    assert store.checkpoints() == [] and store.leftovers() == []
    assert not (folder / "final.pth").exists() and not (folder / "resume.pth").exists()
    assert len((folder / "log.csv").read_text().splitlines()) == 1 + steps_logged


def train(folder, data):
    return call_cli("train", "--out", folder, "--data", data, *SMALL, "--resume", "auto")


def test_sigint_twice_between_steps_exits_130_and_saves_nothing(tmp_path, kjv_folder, monkeypatch):
    interrupt_after_step(monkeypatch, 3, times=2)
    finished = train(tmp_path, kjv_folder)
    assert finished.returncode == 130, finished.stderr
    assert finished.stderr.strip().splitlines() == ["exactresume train: interrupted"]
    assert_nothing_saved(tmp_path, steps_logged=3)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


def test_sigint_during_the_preemption_save_stops_it_at_once(tmp_path, kjv_folder, monkeypatch):
    interrupt_after_step(monkeypatch, 3, times=1)  # the first: finish step 3, then save
    stages = interrupt_when_a_save_writes(monkeypatch)  # the second: while that save writes
    finished = train(tmp_path, kjv_folder)
    assert stages[-1] == "write", stages  # the save was under way when the second signal came
    assert finished.returncode == 130, finished.stderr
    assert finished.stderr.strip().splitlines() == ["exactresume train: interrupted"]
    assert_nothing_saved(tmp_path, steps_logged=3)


# A second SIGTERM is not caught: it ends the process at once, as SIGTERM's default does. That takes
# a process of its own; the same logged-then-signalled hook sends both from inside it, after step 3.
SIGTERM_TWICE = """
import os, signal, sys
from exactresume.cli import main
from exactresume.training.joblog import RunLogs

logged = RunLogs.record

def logged_then_terminated(logs, record):
    logged(logs, record)
    if record.step == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # caught: the run would finish the step and save
        signal.raise_signal(signal.SIGTERM)  # not caught any more: the process ends here

RunLogs.record = logged_then_terminated
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_twice_ends_the_process_at_once_and_saves_nothing(tmp_path, kjv_folder):
    flags = ["train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--save-every", 2, "--resume", "auto"]
    (tmp_path / "terminated.py").write_text(SIGTERM_TWICE)
    finished = run_python(tmp_path / "terminated.py", *flags)
    assert finished.returncode == -signal.SIGTERM, finished.stderr
    assert "Traceback" not in finished.stderr
    store = CheckpointStore(tmp_path / "checkpoints")
    assert [c.step for c in store.checkpoints()] == [2] and store.leftovers() == []  # no save of step 3
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 1 + 3
