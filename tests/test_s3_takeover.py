"""Runs that meet on one s3:// prefix (SeaweedFS): two started together, a holder killed with kill -9.

Whichever run writes the prefix in the end, its run is the straight run's: the final weights
`torch.equal` through a plain torch.load, the loss log byte for byte.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from exactresume.errors import UserError
from exactresume.store.locations import S3Config
from exactresume.store.numbered import CheckpointStore
from exactresume.store.s3.lease import LEASE_NAME, SECONDS_ENV
from helpers import once_per_session, run_cli, spawn_cli, train_cli

# Three saves a run; a run of these holds its prefix long enough (a second or two) for another to meet it.
FLAGS = ["--steps", "60", "--batch", "2", "--seq-len", "16", "--save-every", "20", "--preset", "tiny"]
LEASE = 3.0  # seconds: the killed holder "on another host" is waited for this long


def straight(tmp_path_factory, kjv_folder) -> Path:
    """The straight run with the same flags and no contention, on a local folder: once a session, asked
    for when a test has done its own runs (the other test's worker meanwhile computes it)."""

    def compute(folder: Path) -> dict:
        train_cli(folder, "--data", kjv_folder, *FLAGS, check=True)
        return {"folder": str(folder)}

    return Path(once_per_session(tmp_path_factory, "s3-takeover-straight", compute)["folder"])


def assert_same_as_straight(out: Path, straight: Path) -> None:
    """Final weights torch.equal (each read by a plain torch.load), loss logs equal byte for byte."""
    ours = torch.load(out / "final.pth", weights_only=True)
    theirs = torch.load(straight / "final.pth", weights_only=True)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert (out / "log.csv").read_bytes() == (straight / "log.csv").read_bytes()


def names_under(client, prefix: str) -> set[str]:
    bucket, key = prefix.removeprefix("s3://").split("/", 1)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/").get("Contents", [])
    return {item["Key"].rsplit("/", 1)[1] for item in listed}


def test_two_trains_on_one_prefix_one_trains_the_other_is_refused(
    tmp_path, tmp_path_factory, kjv_folder, s3_server, s3_prefix
):
    reach = ["--s3-endpoint", s3_server.endpoint, "--checkpoints", f"{s3_prefix}/shared"]
    runs = {}
    for name in ("a", "b"):
        runs[name] = spawn_cli("train", "--out", tmp_path / name, "--data", kjv_folder, *FLAGS, *reach)
        time.sleep(0.5)
    ended = {name: (run.wait(), run.output()[1]) for name, run in runs.items()}
    assert sorted(code for code, _ in ended.values()) == [0, 2], ended
    survivor = next(name for name, (code, _) in ended.items() if code == 0)
    refused = next(stderr for code, stderr in ended.values() if code == 2).strip()
    # Refused by the lease the first run holds, or, when the first run committed its first checkpoint
    # before the second listed the prefix (a loaded machine), by that checkpoint, which it has not loaded.
    why = ("is being written by pid", "already holds step-00000020.pth, a checkpoint this store has not loaded")
    assert "\n" not in refused and any(reason in refused for reason in why), refused
    reference = straight(tmp_path_factory, kjv_folder)
    assert_same_as_straight(tmp_path / survivor, reference)
    names = names_under(s3_server.client(), f"{s3_prefix}/shared")
    assert "step-00000060.pth.commit" in names and LEASE_NAME not in names  # released at the end
    # The prefix's newest checkpoint is the straight run's own, to the bit: the refused run wrote nothing.
    ours = CheckpointStore(f"{s3_prefix}/shared", keep=None, config=S3Config(s3_server.endpoint)).load_newest()[1]
    theirs = torch.load(reference / "checkpoints" / "step-00000060.pth", weights_only=True)
    assert ours["step"] == 60 and all(torch.equal(ours["model"][k], v) for k, v in theirs["model"].items())


def kill_after_commit(process, client, prefix: str, step: int) -> None:
    """kill -9 `process` once the checkpoint of `step` is committed under `prefix` (it still trains on)."""
    deadline = time.monotonic() + 120
    while f"step-{step:08d}.pth.commit" not in names_under(client, prefix):
        assert process.poll() is None and time.monotonic() < deadline, process.output()[1]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL


def test_a_holder_killed_with_kill_9_is_taken_over(tmp_path, tmp_path_factory, kjv_folder, s3_server, s3_prefix):
    """On this host at once (its pid is gone); a holder on another host once its lease has gone its
    time without a renewal (here LEASE seconds), and not before."""
    client, out = s3_server.client(), tmp_path / "run"
    command = ["train", "--out", out, "--data", kjv_folder, *FLAGS, "--resume", "auto"]
    command += ["--s3-endpoint", s3_server.endpoint, "--checkpoints", s3_prefix]
    kill_after_commit(spawn_cli(*command), client, s3_prefix, 20)  # its 60 s lease is left behind
    assert LEASE_NAME in names_under(client, s3_prefix)
    # The same command again, without --wait-lock: the killed holder's process is gone, so at once.
    kill_after_commit(spawn_cli(*command, env={SECONDS_ENV: str(LEASE)}), client, s3_prefix, 40)
    bucket, key = s3_prefix.removeprefix("s3://").split("/", 1)
    lease = json.loads(client.get_object(Bucket=bucket, Key=f"{key}/{LEASE_NAME}")["Body"].read())
    assert lease["seconds"] == LEASE and lease["host"] == socket.gethostname()
    # As if that holder had run on another machine: no pid to look at, only its lease's time.
    client.put_object(Bucket=bucket, Key=f"{key}/{LEASE_NAME}", Body=json.dumps(lease | {"host": "elsewhere"}))
    with pytest.raises(UserError, match=f"pid {lease['pid']} on host elsewhere"):
        CheckpointStore(s3_prefix, config=S3Config(s3_server.endpoint)).remove_leftovers()
    started = time.monotonic()
    resumed = run_cli(*command, "--wait-lock", 30)
    assert resumed.returncode == 0 and time.monotonic() - started > LEASE, resumed.stderr
    assert "on host elsewhere" in resumed.stderr and "waiting up to 30 s" in resumed.stderr, resumed.stderr
    assert_same_as_straight(out, straight(tmp_path_factory, kjv_folder))
    assert LEASE_NAME not in names_under(client, s3_prefix)
