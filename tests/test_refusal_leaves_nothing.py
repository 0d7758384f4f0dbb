"""A refused `train` leaves no trace: the --out folder it made is gone, one that was there stays."""

from __future__ import annotations

import pytest

from helpers import SMALL, call_cli, free_port


@pytest.fixture
def credentials(monkeypatch):
    """Keys for the signed requests to a port where no server listens."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "refusal-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "refusal-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def refusals(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    s3 = ["--checkpoints", "s3://exactresume-tests/refused", "--save-every", 2]
    return {
        "nproc": ["--nproc", 3],
        "resume": ["--resume", tmp_path / "nope.pth", "--save-every", 2],
        "endpoint": [*s3, "--s3-endpoint", closed, "--s3-tries", 1, "--s3-timeout", 1],
    }


@pytest.mark.parametrize("refusal", ["nproc", "resume", "endpoint"])
def test_a_refused_run_removes_the_folder_it_made(tmp_path, kjv_folder, credentials, refusal):
    out = tmp_path / "new" / "run"  # the folders it made with it too
    finished = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, *refusals(tmp_path)[refusal])
    assert finished.returncode in (2, 74) and "Traceback" not in finished.stderr, finished.stderr
    assert not out.parent.exists(), sorted(out.parent.rglob("*"))


def test_a_refused_run_keeps_a_folder_that_was_there(tmp_path, kjv_folder):
    out = tmp_path / "there"
    out.mkdir()
    finished = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, *refusals(tmp_path)["nproc"])
    assert finished.returncode == 2 and out.is_dir()
