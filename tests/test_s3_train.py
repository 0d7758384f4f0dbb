"""`train --checkpoints s3://...` against a real S3 server (SeaweedFS): stopped and resumed bit-identical."""

from __future__ import annotations

import json
import os

import boto3
import torch

from exactresume.store.locations import S3Config, location
from exactresume.store.numbered import CheckpointStore
from exactresume.store.s3.client import ObjectStore
from exactresume.store.s3.files import load_committed
from helpers import SMALL, assert_one_line_error, assert_same_run, call_cli, run_cli, train_cli


def train(out, data, endpoint, *flags, check=True):
    return train_cli(out, "--data", data, *SMALL, "--s3-endpoint", endpoint, *flags, check=check)


def test_stop_and_resume_through_s3_is_bit_identical(tmp_path, kjv_folder, s3_server, s3_prefix):
    endpoint, prefix = s3_server.endpoint, f"{s3_prefix}/run/checkpoints"
    train(tmp_path / "straight", kjv_folder, endpoint)
    stopped = tmp_path / "stopped"
    train(stopped, kjv_folder, endpoint, "--checkpoints", prefix, "--save-every", 2, "--stop-at", 3)
    resume = location(f"{prefix}/resume.pth", S3Config(endpoint))
    state = load_committed(ObjectStore(resume.config), resume)
    assert state["step"] == 3 and {"model", "optimizer", "gen_state"} <= state.keys()
    store = CheckpointStore(prefix, config=S3Config(endpoint))
    assert [c.step for c in store.checkpoints()] == [2, 3]  # every 2 steps, and where it stopped
    train(stopped, kjv_folder, endpoint, "--resume", f"{prefix}/resume.pth", "--checkpoints", prefix, "--save-every", 2)
    assert_same_run(stopped, tmp_path / "straight")
    assert [c.step for c in store.checkpoints()] == [4, 6, 8]  # keep 3: the older deleted once 8 committed
    _inspect_and_diff(stopped, endpoint, prefix)


def _inspect_and_diff(out, endpoint, prefix):
    """inspect and diff read the store as they read files; no output holds the credential."""
    reach = ("--s3-endpoint", endpoint)
    listing = call_cli("inspect", prefix, *reach, "--json")
    assert listing.returncode == 0, listing.stderr
    assert [c["step"] for c in json.loads(listing.stdout)["checkpoints"]] == [4, 6, 8]
    resume = call_cli("inspect", f"{prefix}/resume.pth", *reach, "--json")
    assert resume.returncode == 0 and json.loads(resume.stdout)["step"] == 3, resume.stderr
    same = call_cli("diff", f"{prefix}/step-00000008.pth", out / "final.pth", *reach)
    assert same.returncode == 0 and "equal" in same.stdout, same.stdout + same.stderr
    missing = call_cli("diff", f"{prefix}/step-00000001.pth", out / "final.pth", *reach)
    assert_one_line_error(missing, "s3://", "no such object")
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    for finished in (listing, resume, same, missing):
        assert secret not in finished.stdout + finished.stderr
    bucket, key = prefix.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=endpoint)
    for entry in client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]:
        assert secret.encode() not in client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read()


def test_resume_auto_from_the_newest_committed_checkpoint(tmp_path, kjv_folder, s3_server, s3_prefix):
    endpoint, prefix = s3_server.endpoint, f"{s3_prefix}/auto"
    train(tmp_path / "straight", kjv_folder, endpoint)
    out = tmp_path / "run"
    flags = ("--checkpoints", prefix, "--save-every", 3, "--resume", "auto")
    train(out, kjv_folder, endpoint, *flags, "--steps", 8, "--stop-at", 5)
    # The endpoint from the environment, as the AWS chain reads it (no --s3-endpoint).
    command = ["train", "--out", out, "--data", kjv_folder, *SMALL, *flags]
    finished = run_cli(*command, check=True, env={"AWS_ENDPOINT_URL": endpoint})
    assert "resumed from s3://" in finished.stderr + finished.stdout
    assert_same_run(out, tmp_path / "straight")
    objects = ObjectStore(S3Config(endpoint))
    newest = location(f"{prefix}/step-00000008.pth", S3Config(endpoint))
    assert torch.equal(load_committed(objects, newest)["model"]["lm_head.weight"], _final(out)["lm_head.weight"])


def _final(out):
    from exactresume.store.weights import read_weights

    return read_weights(out / "final.pth")[0]
