"""One writer per s3:// prefix: the lease (store/s3_lease.py), against moto's S3 in this process."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

from exactresume.errors import UserError
from exactresume.store.folder import CheckpointStore
from exactresume.store.s3_lease import LEASE_NAME, SECONDS_ENV

BUCKET = "leases"


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 in this process, with one bucket; yields its boto3 client."""
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "moto-key", "AWS_SECRET_ACCESS_KEY": "moto-secret"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client


def store(**options) -> CheckpointStore:
    return CheckpointStore(f"s3://{BUCKET}/run", keep=1, notify=lambda message: None, **options)


def state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((4,), float(step))}}


def keys(client) -> set[str]:
    return {item["Key"] for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])}


def test_a_second_writer_is_refused_naming_the_holder(s3):
    first, second = store(), store()
    first.commit(1, state(1))
    with pytest.raises(UserError) as refused:
        second.commit(2, state(2))
    line = str(refused.value)
    assert "\n" not in line and f"pid {os.getpid()}" in line and socket.gethostname() in line
    assert "s3://leases/run is being written" in line
    assert f"run/{LEASE_NAME}" in keys(s3) and "run/step-00000002.pth" not in keys(s3)
    first.close()


def test_the_lease_is_released_at_close_and_then_another_writer_may_take_it(s3):
    with store() as first:
        first.commit(1, state(1))
    assert f"run/{LEASE_NAME}" not in keys(s3)
    with store() as second:
        second.commit(2, state(2))


def test_an_expired_lease_is_taken_over(s3, monkeypatch):
    monkeypatch.setenv(SECONDS_ENV, "0.3")
    first = store()
    first.commit(1, state(1))
    first.lease.stopped.set()  # its holder died: nothing renews it
    time.sleep(0.5)
    second = store()
    second.remove_leftovers()
    assert (
        json.loads(s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read())["token"] == second.lease.token
    )
    with pytest.raises(UserError, match="lost its lease"):
        first.commit(2, state(2))
    second.close()


def test_wait_lock_waits_for_the_holder_to_finish(s3):
    first = store()
    first.remove_leftovers()
    started = time.monotonic()
    threading.Timer(0.6, first.close).start()
    second = store(wait_lock=5.0)
    second.remove_leftovers()
    assert 0.5 < time.monotonic() - started < 5
    second.close()


def test_a_run_whose_lease_was_taken_commits_and_deletes_nothing(s3):
    run = store()
    run.commit(1, state(1))
    thief = {"pid": 4242, "host": "elsewhere", "since": time.time(), "token": "x", "expires": time.time() + 60}
    s3.put_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}", Body=json.dumps(thief).encode())
    before = {key: s3.head_object(Bucket=BUCKET, Key=key)["ETag"] for key in keys(s3)}
    with pytest.raises(UserError) as refused:
        run.commit(2, state(2))  # keep=1 would delete step 1
    assert "pid 4242 on host elsewhere" in str(refused.value) and "\n" not in str(refused.value)
    assert {key: s3.head_object(Bucket=BUCKET, Key=key)["ETag"] for key in keys(s3)} == before
    run.close()
    assert f"run/{LEASE_NAME}" in keys(s3)  # the other run's lease is left to it


def test_seaweedfs_refuses_a_second_writer_and_hands_over_an_expired_lease(s3_server, s3_prefix, monkeypatch):
    from exactresume.store.locations import S3Config

    monkeypatch.setenv(SECONDS_ENV, "0.5")
    config = S3Config(s3_server.endpoint)
    first = CheckpointStore(s3_prefix, keep=1, config=config)
    first.commit(1, state(1))
    with pytest.raises(UserError, match=f"is being written by pid {os.getpid()}"):
        CheckpointStore(s3_prefix, keep=1, config=config).commit(2, state(2))
    first.lease.stopped.set()  # its holder died: nothing renews it
    time.sleep(0.8)
    second = CheckpointStore(s3_prefix, keep=1, config=config)
    second.commit(2, state(2))
    with pytest.raises(UserError, match="lost its lease"):
        first.commit(3, state(3))
    assert [c.step for c in second.checkpoints()] == [2]
    second.close()


def test_two_trains_on_one_prefix_one_trains_the_other_is_refused(tmp_path, kjv_folder, s3_server, s3_prefix):
    from conftest import spawn_cli

    flags = ["--steps", "300", "--batch", "2", "--seq-len", "16", "--save-every", "100"]
    reach = ["--s3-endpoint", s3_server.endpoint, "--checkpoints", f"{s3_prefix}/shared"]
    runs = []
    for name in ("a", "b"):
        runs.append(spawn_cli("train", "--out", tmp_path / name, "--data", kjv_folder, *flags, *reach))
        time.sleep(0.5)
    ended = [(run.wait(), run.output()[1]) for run in runs]
    codes = sorted(code for code, _ in ended)
    assert codes == [0, 2], ended
    refused = next(stderr for code, stderr in ended if code == 2).strip()
    assert "\n" not in refused and "is being written by pid" in refused, refused
    bucket, key = f"{s3_prefix}/shared".removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    names = {item["Key"].rsplit("/", 1)[1] for item in client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]}
    assert "step-00000300.pth.commit" in names and LEASE_NAME not in names  # released at the end


def test_a_killed_holder_on_this_host_is_taken_over_at_once(s3):
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = {"pid": gone.pid, "host": socket.gethostname(), "since": 0, "token": "x", "expires": time.time() + 60}
    s3.put_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}", Body=json.dumps(holder).encode())
    with store() as taker:
        taker.commit(1, state(1))
        assert (
            json.loads(s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read())["token"]
            == taker.lease.token
        )
