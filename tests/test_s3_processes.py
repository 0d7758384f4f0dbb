"""Two processes and FSDP2 with their checkpoints on a real S3 server (SeaweedFS): each rank uploads its
own shard objects, rank 0 commits once every rank has, and a resume from the store is bit-identical.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from exactresume.core.steplog import read_samples
from exactresume.store.faults import FAULT_ENV
from exactresume.store.locations import S3Config, location
from exactresume.store.s3.kinds import local_copy
from exactresume.store.s3.lease import LEASE_NAME
from exactresume.store.sharded import verify_sharded
from helpers import assert_weights_equal, max_abs_difference, spawn_cli, train_cli

# a batch of 4 splits over 1 and 2 processes
FLAGS = ["--steps", "8", "--batch", "4", "--seq-len", "16", "--preset", "tiny"]
STOP = 3
CROSS_N_ATOL = 1e-4  # what only the order of floating-point reduction moves (tests/test_fsdp.py)


def train(out: Path, data: Path, endpoint: str, *flags: object) -> None:
    reach = ["--s3-endpoint", endpoint, "--samples", out / "samples.csv"]
    train_cli(out, "--data", data, *FLAGS, *reach, *flags, check=True, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture
def straight_two(tmp_path_factory, kjv_folder, s3_server) -> Path:
    """The straight run on two processes (DDP) to compare with."""
    folder = tmp_path_factory.mktemp("straight-two")
    train(folder, kjv_folder, s3_server.endpoint, "--nproc", 2)
    return folder


@pytest.fixture
def straight_one(tmp_path_factory, kjv_folder, s3_server) -> Path:
    """The straight run on one process to compare with."""
    folder = tmp_path_factory.mktemp("straight-one")
    train(folder, kjv_folder, s3_server.endpoint)
    return folder


def committed_shards(endpoint: str, prefix: str) -> dict:
    """The commit of a sharded resume state on the store, from a verified local copy."""
    with local_copy(location(prefix, S3Config(endpoint))) as local:
        return verify_sharded(local)


def test_two_processes_each_upload_a_shard_then_resume_bit_identical(
    tmp_path, kjv_folder, s3_server, s3_prefix, straight_two
):
    endpoint, out = s3_server.endpoint, tmp_path / "run"
    flags = ("--nproc", 2, "--checkpoints", s3_prefix, "--save-every", 2)
    train(out, kjv_folder, endpoint, *flags, "--sharded", "--stop-at", STOP)
    commit = committed_shards(endpoint, f"{s3_prefix}/resume.dcp")
    assert commit["processes"] == 2 and {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= commit["files"].keys()
    train(out, kjv_folder, endpoint, *flags, "--resume", f"{s3_prefix}/resume.dcp")
    assert_weights_equal(straight_two / "final.pth", out / "final.pth")
    assert (out / "log.csv").read_bytes() == (straight_two / "log.csv").read_bytes()
    _a_run_that_lost_the_prefix_leaves_its_sharded_state_alone(tmp_path, kjv_folder, s3_server, s3_prefix)


def _a_run_that_lost_the_prefix_leaves_its_sharded_state_alone(tmp_path, data, s3_server, prefix):
    """Rank 0 checks the run's lease before the sharded save deletes the old commit: taken by another
    run meanwhile, the save stops, on every rank, in rank 0's one line, with the old resume.dcp as it was."""
    client, bucket, key = s3_server.client(), *prefix.removeprefix("s3://").split("/", 1)
    flags = ["--steps", "40", "--batch", "4", "--seq-len", "16", "--stop-at", "30", "--sharded", "--nproc", 2]
    flags += ["--preset", "tiny"]
    reach = ["--checkpoints", prefix, "--s3-endpoint", s3_server.endpoint]
    run = spawn_cli("train", "--out", tmp_path / "late", "--data", data, *flags, *reach, env={"OMP_NUM_THREADS": "1"})
    lease = f"{key}/{LEASE_NAME}"
    while run.poll() is None and not client.list_objects_v2(Bucket=bucket, Prefix=lease).get("KeyCount"):
        time.sleep(0.02)  # until the run holds the prefix
    thief = {"pid": 4242, "host": "elsewhere", "since": time.time(), "token": "theirs", "seconds": 60}
    client.put_object(Bucket=bucket, Key=lease, Body=json.dumps(thief).encode())
    before = {item["Key"]: item["ETag"] for item in client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]}
    code, stderr = run.wait(), run.output()[1].strip()
    # "lost its lease" when the thief's lease replaced the run's while it held it; "is being written by" when
    # it replaced one the run had let go (its load's) before the save took the prefix again: both stop the run
    refused = "lost its lease: " in stderr or "is being written by pid 4242" in stderr
    assert code == 2 and "\n" not in stderr and refused and "pid 4242" in stderr, (code, stderr)
    after = {item["Key"]: item["ETag"] for item in client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]}
    assert after == before and f"{key}/resume.dcp/commit.pth" in after


def test_fsdp_checkpoints_are_sharded_on_the_store_and_a_kill_mid_upload_resumes_bit_identical(
    tmp_path, kjv_folder, s3_server, s3_prefix
):
    """Under --shard fsdp every rank uploads its own shard of each checkpoint, rank 0 commits last: a rank
    killed in its upload leaves the previous checkpoint the newest committed, and --resume auto continues
    from it as the straight run went; on 1 and 4 processes, resharded, with the same samples."""
    endpoint, fsdp = s3_server.endpoint, ("--nproc", 2, "--shard", "fsdp")
    train(tmp_path / "straight", kjv_folder, endpoint, *fsdp)
    out, flags = tmp_path / "run", (*fsdp, "--checkpoints", s3_prefix, "--save-every", 2, "--resume", "auto")
    reach = ("--s3-endpoint", endpoint, "--samples", out / "samples.csv")
    env = {"OMP_NUM_THREADS": "1", FAULT_ENV: "upload@3:kill"}  # rank 0's 2nd save: its shard, then DCP's index
    killed = train_cli(out, "--data", kjv_folder, *FLAGS, *reach, *flags, env=env)
    assert killed.returncode != 0, killed.stdout
    client, bucket, key = s3_server.client(), *s3_prefix.removeprefix("s3://").split("/", 1)

    def commits() -> list[str]:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/")["Contents"]
        return sorted(item["Key"].removeprefix(f"{key}/") for item in listed if item["Key"].endswith("/commit.pth"))

    assert commits() == ["step-00000002.dcp/commit.pth"]
    straight = read_samples(tmp_path / "straight" / "samples.csv")
    for nproc in (1, 4):  # the committed checkpoint resharded: each rank fetches the ranges of its rows
        other = tmp_path / f"on-{nproc}"
        resharded = ("--nproc", nproc, "--shard", "fsdp", "--resume", f"{s3_prefix}/step-00000002.dcp")
        train(other, kjv_folder, endpoint, *resharded)
        assert read_samples(other / "samples.csv") == {step: straight[step] for step in range(3, 9)}
        assert max_abs_difference(tmp_path / "straight" / "final.pth", other / "final.pth") < CROSS_N_ATOL
    train(out, kjv_folder, endpoint, *flags)
    assert_weights_equal(tmp_path / "straight" / "final.pth", out / "final.pth")
    assert commits() == [f"step-0000000{step}.dcp/commit.pth" for step in (4, 6, 8)]  # keep 3
    shards = committed_shards(endpoint, f"{s3_prefix}/step-00000008.dcp")
    assert shards["processes"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= shards["files"].keys()
