"""Two processes and FSDP2 with their checkpoints on a real S3 server (SeaweedFS): each rank uploads its
own shard objects, rank 0 commits once every rank has, and a resume from the store is bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_weights_equal, max_abs_difference, run_cli
from exactresume.store.locations import S3Config, location
from exactresume.store.s3_kinds import local_copy
from exactresume.store.sharded import verify_sharded
from exactresume.store.steplog import read_samples

FLAGS = ["--steps", "8", "--batch", "4", "--seq-len", "16"]  # a batch of 4 splits over 1 and 2 processes
STOP = 3
CROSS_N_ATOL = 1e-4  # what only the order of floating-point reduction moves (tests/test_fsdp.py)


def train(out: Path, data: Path, endpoint: str, *flags: object) -> None:
    reach = ["--s3-endpoint", endpoint, "--samples", out / "samples.csv"]
    run_cli("train", "--out", out, "--data", data, *FLAGS, *reach, *flags, check=True, env={"OMP_NUM_THREADS": "1"})


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


def test_fsdp_stopped_on_two_resumed_on_one_from_the_store(tmp_path, kjv_folder, s3_server, s3_prefix, straight_one):
    """On one process the reduction order differs (tests/test_fsdp.py); from the store it is the same
    run, to the bit, as from the same bytes on a disk."""
    endpoint, stopped = s3_server.endpoint, tmp_path / "stopped"
    train(stopped, kjv_folder, endpoint, "--nproc", 2, "--shard", "fsdp", "--checkpoints", s3_prefix, "--stop-at", STOP)
    state = f"{s3_prefix}/resume.dcp"
    assert committed_shards(endpoint, state)["processes"] == 2
    from_store, from_disk = tmp_path / "from-store", tmp_path / "from-disk"
    train(from_store, kjv_folder, endpoint, "--shard", "fsdp", "--resume", state)
    with local_copy(location(state, S3Config(endpoint))) as local:
        train(from_disk, kjv_folder, endpoint, "--shard", "fsdp", "--resume", local)
    assert_weights_equal(from_disk / "final.pth", from_store / "final.pth")
    reference = read_samples(straight_one / "samples.csv")
    assert read_samples(from_store / "samples.csv") == {step: reference[step] for step in range(STOP + 1, 9)}
    assert max_abs_difference(straight_one / "final.pth", from_store / "final.pth") < CROSS_N_ATOL
