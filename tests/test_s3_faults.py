"""`train --checkpoints s3://...` against a real S3 server through kill -9, damaged objects and a server
that stops: what is committed stays trusted, nothing else is, and `--resume auto` ends bit-identical.
"""

from __future__ import annotations

import random
import signal
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SMALL, assert_one_line_error, assert_same_run, call_cli, one_torch_thread, run_cli, spawn_cli
from exactresume.store.faults import FAULT_ENV, OBJECT_STORE_STAGES
from exactresume.store.folder import CheckpointStore
from exactresume.store.locations import S3Config
from exactresume.store.s3_files import COPY_PREFIX

# Parts of 5 MiB: a checkpoint of the small run (20 MB) goes up as a multipart upload of four.
PARTS = ("--s3-part-mib", "5")


def train_flags(out: Path, data: Path, endpoint: str | None = None, *extra: object) -> list:
    reach = ["--s3-endpoint", endpoint, *PARTS] if endpoint else []
    return ["train", "--out", out, "--data", data, *SMALL, "--samples", out / "samples.csv", *reach, *extra]


def chaos_flags(out: Path, data: Path, endpoint: str | None = None, prefix: str | None = None) -> list:
    where = ["--checkpoints", prefix] if prefix else []
    return train_flags(out, data, endpoint, *where, "--save-every", 1, "--keep", 2, "--resume", "auto")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kjv_folder) -> Path:
    """The uninterrupted run (local checkpoints; the same steps, logs and weights), in this process."""
    folder = tmp_path_factory.mktemp("reference")
    with one_torch_thread():
        finished = call_cli(*chaos_flags(folder, kjv_folder))
    assert finished.returncode == 0, finished.stderr
    return folder


def committed(endpoint: str, prefix: str) -> list[int]:
    """The steps committed under `prefix`; every one of them must load and verify."""
    store = CheckpointStore(prefix, keep=None, notify=pytest.fail, config=S3Config(endpoint))
    steps = [c.step for c in store.checkpoints()]
    for step in steps:
        assert store.load_newest() is not None, step
    return steps


KILL_POINTS = ["write@1", "upload@1", "upload@2", "upload@3", "upload@4", "commit@1", "retention@1"]


def test_the_kill_points_cover_every_stage_of_an_upload():
    """Every stage of a save to an object store but the snapshot, which happens before any upload."""
    assert {point.split("@")[0] for point in KILL_POINTS} == set(OBJECT_STORE_STAGES) - {"snapshot"}


def test_kill_9_during_uploads_then_resume_auto_is_bit_exact(tmp_path, kjv_folder, reference, s3_server, s3_prefix):
    """22 kills at random points of a save (the write, each part's upload, the commit, retention)."""
    out, endpoint, chooser = tmp_path / "run", s3_server.endpoint, random.Random(26)
    for kill in range(22):
        fault = chooser.choice(KILL_POINTS)
        finished = run_cli(
            *chaos_flags(out, kjv_folder, endpoint, s3_prefix), env={"OMP_NUM_THREADS": "1", FAULT_ENV: fault}
        )
        assert finished.returncode == -signal.SIGKILL, (kill, fault, finished.stderr)
        steps = committed(endpoint, s3_prefix)
        assert len(steps) <= 3 and steps == sorted(steps), (fault, steps)  # keep 2, and a third before retention
    finished = run_cli(*chaos_flags(out, kjv_folder, endpoint, s3_prefix), env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0, finished.stderr
    assert_same_run(out, reference)
    bucket, key = s3_prefix.removeprefix("s3://").split("/", 1)
    assert s3_server.client().list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []
    # The local copies the killed saves left (in /dev/shm: memory) were removed by the runs after them.
    copies = [*Path("/dev/shm").glob(f"{COPY_PREFIX}*-*"), *Path(tempfile.gettempdir()).glob(f"{COPY_PREFIX}*-*")]
    assert not [copy for copy in copies if not Path(f"/proc/{copy.name[len(COPY_PREFIX) :].split('-')[0]}").exists()]


@pytest.fixture(scope="module")
def victim(tmp_path_factory, kjv_folder, s3_server) -> tuple[Path, str]:
    """A run stopped at step 4 with checkpoints at 2 and 4 and a sharded resume state on the store."""
    out, prefix = tmp_path_factory.mktemp("victim"), s3_server.new_prefix()
    flags = train_flags(out, kjv_folder, s3_server.endpoint, "--checkpoints", prefix, "--save-every", 2)
    with one_torch_thread():
        finished = call_cli(*flags, "--stop-at", 4, "--sharded")
    assert finished.returncode == 0, finished.stderr
    return out, prefix


def damage(client, key: str, how: str) -> None:
    bucket, key = key.removeprefix("s3://").split("/", 1)
    if how == "delete":
        client.delete_object(Bucket=bucket, Key=key)
        return
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    at = min(4000, len(data) // 2)
    data = data[:at] if how == "truncate" else data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1 :]
    client.put_object(Bucket=bucket, Key=key, Body=data)


@pytest.mark.parametrize(
    "name, how, reason",
    [
        ("step-00000004.pth", "flip", "checksum mismatch"),
        ("step-00000004.pth", "truncate", "truncated or replaced"),
        ("step-00000004.pth.commit", "delete", "was never committed"),
        ("step-00000004.pth.commit", "flip", "checksum mismatch"),
    ],
)
def test_damaged_checkpoint_refused_in_one_line_and_auto_uses_the_previous(
    tmp_path, kjv_folder, s3_server, victim, name, how, reason
):
    out, prefix = victim
    copy = s3_server.new_prefix()  # each case damages its own copy of the victim's objects
    _copy_prefix(s3_server.client(), prefix, copy)
    damage(s3_server.client(), f"{copy}/{name}", how)
    step_file = f"{copy}/step-00000004.pth"
    refused = call_cli(*train_flags(tmp_path / "a", kjv_folder, s3_server.endpoint, "--resume", step_file))
    assert_one_line_error(refused, reason, "s3://")
    with one_torch_thread():
        auto = call_cli(
            *train_flags(
                tmp_path / "b",
                kjv_folder,
                s3_server.endpoint,
                "--checkpoints",
                copy,
                "--save-every",
                2,
                "--resume",
                "auto",
                "--steps",
                8,
            )
        )
    assert auto.returncode == 0, auto.stderr
    assert f"resumed from {copy}/step-00000002.pth at step 2" in auto.stdout


@pytest.mark.parametrize(
    "name, how, reason",
    [("__0_0.distcp", "delete", "missing, though its commit names it"), ("commit.pth", "delete", "never committed")],
)
def test_damaged_sharded_folder_is_refused_in_one_line(tmp_path, kjv_folder, s3_server, victim, name, how, reason):
    out, prefix = victim
    copy = s3_server.new_prefix()
    _copy_prefix(s3_server.client(), prefix, copy)
    damage(s3_server.client(), f"{copy}/resume.dcp/{name}", how)
    refused = call_cli(*train_flags(tmp_path, kjv_folder, s3_server.endpoint, "--resume", f"{copy}/resume.dcp"))
    assert_one_line_error(refused, reason)


def _copy_prefix(client, source: str, target: str) -> None:
    bucket, source_key = source.removeprefix("s3://").split("/", 1)
    target_key = target.removeprefix("s3://").split("/", 1)[1]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=source_key + "/"):
        for entry in page.get("Contents", []):
            new = target_key + entry["Key"][len(source_key) :]
            client.copy_object(Bucket=bucket, Key=new, CopySource={"Bucket": bucket, "Key": entry["Key"]})


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_server_stopped_mid_run_stops_in_one_line_then_resumes(tmp_path, kjv_folder, reference, s3_server, s3_prefix):
    out, endpoint = tmp_path / "run", s3_server.endpoint
    env = {"OMP_NUM_THREADS": "1", FAULT_ENV: "upload@9:stop"}  # frozen in its third save's upload
    child = spawn_cli(*chaos_flags(out, kjv_folder, endpoint, s3_prefix), "--s3-tries", "3", env=env)
    while not _stopped(child.pid) and child.poll() is None:
        time.sleep(0.05)
    s3_server.stop()
    try:
        child.send_signal(signal.SIGCONT)
        _, stderr = child.communicate(timeout=120)
    finally:
        s3_server.start()
    assert child.returncode == 74, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0] and "3 tries" in lines[0] and "Traceback" not in stderr, stderr
    assert committed(endpoint, s3_prefix) == [1, 2]
    finished = run_cli(*chaos_flags(out, kjv_folder, endpoint, s3_prefix), env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0, finished.stderr
    assert_same_run(out, reference)
