"""Runs forked from a fork server (forkserver/): one ends exactly as a cold process does, says a refusal in
one line, runs beside others and takes signals; a script forked from the doctor's traced server sees
its own argv, folder and environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from exactresume.forkserver import client as forkserver
from exactresume.lab import runs
from exactresume.store.weights import read_weights
from helpers import SMALL, assert_one_line_error, process_state, run_python


def test_forked_run_equals_cold_process_run(tmp_path, kjv_folder):
    def flags(name: str) -> list[str]:
        return [
            str(a)
            for a in [
                "train",
                "--out",
                tmp_path / name,
                "--data",
                kjv_folder,
                *SMALL,
                "--log",
                tmp_path / f"{name}.csv",
            ]
        ]

    warm = runs.run_cli(flags("warm"))
    assert warm.returncode == 0, warm.stderr
    cold = subprocess.run([sys.executable, "-m", "exactresume", *flags("cold")], capture_output=True, text=True)
    assert cold.returncode == 0, cold.stderr
    warm_weights, cold_weights = (
        read_weights(tmp_path / "warm" / "final.pth")[0],
        read_weights(tmp_path / "cold" / "final.pth")[0],
    )
    assert all(torch.equal(warm_weights[name], cold_weights[name]) for name in cold_weights)
    assert (tmp_path / "warm.csv").read_text() == (tmp_path / "cold.csv").read_text()


def test_forked_run_reports_a_refusal_in_one_line(tmp_path, kjv_folder):
    finished = runs.run_cli(["train", "--out", str(tmp_path), "--data", str(kjv_folder), *SMALL, "--stop-at", "99"])
    assert_one_line_error(finished, "--stop-at")


def test_spawned_runs_run_side_by_side_and_signals_reach_each(tmp_path, kjv_folder):
    train = ["train", "--out", str(tmp_path / "killed"), "--data", str(kjv_folder), *SMALL]
    killed, asked = runs.spawn_cli(train), runs.spawn_cli(["--help"])
    assert len({killed.pid, asked.pid, os.getpid()}) == 3 and killed.poll() is None
    killed.kill()
    assert killed.wait(timeout=60) == -signal.SIGKILL and killed.poll() == -signal.SIGKILL
    stdout, stderr = asked.communicate(timeout=60)
    assert asked.returncode == 0 and "usage: exactresume" in stdout, stderr
    assert not (tmp_path / "killed" / "final.pth").exists()


def test_a_forked_run_finds_its_temp_folder_from_its_own_environment(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import tempfile\nprint(tempfile.gettempdir())\n")
    found = run_python(script, env={"TMPDIR": str(tmp_path)})  # its server had found its own (torch asks)
    assert found.returncode == 0 and found.stdout.strip() == str(tmp_path), found.stdout


def test_a_server_that_ends_as_asked_leaves_no_folder_in_the_temp_folder():
    kind = forkserver.ServerKind(preload=("json",))  # a server of this test's own
    assert forkserver.spawn([sys.executable, "-m", "json.tool", "--help"], kind=kind).wait() == 0
    key = next(key for key in forkserver._servers if key[1] == kind)
    folder = forkserver._servers[key].log.parent
    assert folder.is_dir() and folder.name.startswith("exactresume-fork-server-")
    forkserver._servers.pop(key).close()
    assert not folder.exists()


def test_the_runs_of_a_server_whose_caller_is_gone_end_with_it(tmp_path):
    """Its stdin closed (the caller ended or was killed): a run still going is killed, not left to write."""
    kind = forkserver.ServerKind(preload=("time",))  # a server of this test's own
    marker = tmp_path / "written"
    script = tmp_path / "late.py"
    script.write_text(f"import time, pathlib\ntime.sleep(3)\npathlib.Path({str(marker)!r}).write_text('late')\n")
    run = forkserver.spawn([sys.executable, str(script)], kind=kind)
    key = next(key for key in forkserver._servers if key[1] == kind)
    forkserver._servers.pop(key).close()  # as at the caller's exit
    assert process_state(run.pid) is None
    time.sleep(3.5)
    assert not marker.exists()
