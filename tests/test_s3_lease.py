"""One writer per s3:// prefix: the lease (store/s3_lease.py), against moto's S3 in this process."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import UTC

import pytest
import torch

from exactresume.errors import UserError
from exactresume.store.numbered import CheckpointStore
from exactresume.store.s3.lease import LEASE_NAME, SECONDS_ENV

BUCKET = "leases"


@pytest.fixture
def s3(moto_s3):
    """moto's S3 (conftest.moto_s3) with this module's bucket; its boto3 client."""
    moto_s3.create_bucket(Bucket=BUCKET)
    return moto_s3


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
    first.place.lease.stopped.set()  # its holder died: nothing renews it
    second = store(wait_lock=30.0)
    started = time.monotonic()
    second.remove_leftovers()  # moto sends no Date: the waiter's own clock sees it unrenewed for 0.3 s
    assert time.monotonic() - started >= 0.3
    holder = json.loads(s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read())
    assert holder["token"] == second.place.lease.token
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
    first.place.lease.stopped.set()  # its holder died: nothing renews it
    second = CheckpointStore(s3_prefix, keep=1, config=config, wait_lock=30.0)
    second.commit(2, state(2))
    with pytest.raises(UserError, match="lost its lease"):
        first.commit(3, state(3))
    assert [c.step for c in second.checkpoints()] == [2]
    second.close()


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
            == taker.place.lease.token
        )


# ---- the clocks: a lease's time is measured by the server's clock, or by the waiter's own ----


def plant(client, **holder) -> None:
    """A lease of another run, on another host (alive as far as this host can tell)."""
    lease = {"pid": 4242, "host": "elsewhere", "since": time.time(), "token": "theirs", "seconds": 60} | holder
    client.put_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}", Body=json.dumps(lease).encode())


def test_a_lease_from_a_clock_an_hour_behind_is_still_honoured(s3):
    plant(s3, since=time.time() - 7200, expires=time.time() - 3600)  # its writer's wall clock: long expired
    with pytest.raises(UserError, match="pid 4242 on host elsewhere"):
        store().remove_leftovers()
    assert "theirs" in s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read().decode()


def test_a_lease_from_a_clock_an_hour_ahead_expires_after_its_own_time(s3):
    plant(s3, seconds=0.3, expires=time.time() + 3600)  # its writer's wall clock: valid for an hour
    started = time.monotonic()
    with store(wait_lock=30.0) as taker:
        taker.remove_leftovers()
        assert time.monotonic() - started >= 0.3
        assert json.loads(s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read())["token"] == (
            taker.place.lease.token
        )


def test_the_servers_date_against_last_modified_decides_at_first_sight():
    import io
    from datetime import datetime, timedelta
    from email.utils import format_datetime

    from exactresume.store.s3.lease import S3Lease, _seen

    modified = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    lease = S3Lease(objects=None, folder=None, seconds=60)
    holder = {"pid": 4242, "host": "elsewhere", "token": "theirs", "seconds": 3, "expires": 0}
    for after, expired in ((5, True), (3.5, False), (1, False)):  # a second's slack: HTTP dates are whole seconds
        date = format_datetime(modified + timedelta(seconds=after), usegmt=True)
        answer = {"Body": io.BytesIO(json.dumps(holder).encode()), "LastModified": modified, "ETag": '"e"'}
        seen = _seen(answer | {"ResponseMetadata": {"HTTPHeaders": {"date": date}}})
        assert seen.age == int(after) and lease._expired(seen) is expired, after
        lease.watched = None


def test_seaweedfs_sends_the_date_the_lease_is_judged_by(s3_server, s3_prefix):
    from exactresume.store.locations import S3Config, location
    from exactresume.store.s3.client import ObjectStore
    from exactresume.store.s3.lease import S3Lease

    folder = location(s3_prefix, S3Config(s3_server.endpoint))
    lease = S3Lease.acquire(ObjectStore(folder.config), folder)
    seen = lease._read()
    lease.release()
    assert seen.holder["token"] == lease.token and seen.age is not None and -1 <= seen.age <= 2


# ---- every writer to a prefix: the resume file of --stop-at and a sharded folder check the same lease ----


def parts() -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(4, 4)}


def versions(client) -> dict[str, str]:
    return {key: client.head_object(Bucket=BUCKET, Key=key)["ETag"] for key in keys(client)}


@pytest.mark.parametrize("name, sharded", [("resume.pth", False), ("resume.dcp", True)])
def test_the_resume_state_is_written_under_the_runs_lease(s3, name, sharded):
    from exactresume.store.access import save_resume

    target = f"s3://{BUCKET}/run/{name}"
    with store() as run:
        run.commit(1, state(1))
        save_resume(target, parts(), 1, sharded=sharded)  # the run's own lease: no second one is taken
        assert json.loads(s3.get_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")["Body"].read())["token"] == (
            run.place.lease.token
        )
        plant(s3)  # another run took the prefix
        before = versions(s3)
        with pytest.raises(UserError, match="lost its lease: s3://leases/run is being written by pid 4242"):
            save_resume(target, parts(), 2, sharded=sharded)
        assert versions(s3) == before  # the old resume state and its commit are as they were


@pytest.mark.parametrize("name, sharded", [("resume.pth", False), ("resume.dcp", True)])
def test_a_resume_state_written_alone_takes_the_prefixs_lease(s3, name, sharded):
    from exactresume.store.access import save_resume

    plant(s3)
    target = f"s3://{BUCKET}/run/{name}"
    with pytest.raises(UserError, match="is being written by pid 4242 on host elsewhere"):
        save_resume(target, parts(), 1, sharded=sharded)
    assert keys(s3) == {f"run/{LEASE_NAME}"}
    s3.delete_object(Bucket=BUCKET, Key=f"run/{LEASE_NAME}")
    save_resume(target, parts(), 1, sharded=sharded)
    assert f"run/{LEASE_NAME}" not in keys(s3) and any(key.startswith(f"run/{name}") for key in keys(s3))
