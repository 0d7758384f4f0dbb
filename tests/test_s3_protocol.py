"""The commit protocol on an object store, against moto's in-process S3: what a reader trusts, and faults.

Faults a real server rarely shows on demand are injected into the client: a part that fails once, a
completed multipart upload that lost a part (mlcommons/storage #593), a listing that lags behind.
"""

from __future__ import annotations

import io
import os
import threading
import time

import pytest
import torch
import xxhash

from exactresume.errors import CheckpointError, StorageError, UserError
from exactresume.store.locations import S3Config, S3Location, location
from exactresume.store.numbered import CheckpointStore
from exactresume.store.s3 import upload as s3_upload
from exactresume.store.s3.client import ObjectStore
from exactresume.store.s3.commit import commit_of
from exactresume.store.s3.files import fetch_file, load_committed, local_folder, publish_sealed
from exactresume.store.sealed import save_sealed
from helpers import MOTO_SECRET

BUCKET = "protocol"


class Tensor:
    """A part holding one tensor (a checkpoint of `size` float32 values)."""

    def __init__(self, value: float = 0.0, size: int = 1000):
        self.tensor = torch.full((size,), value)

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"]


@pytest.fixture
def s3(moto_s3):
    """moto's S3 (conftest.moto_s3) with this module's bucket; its boto3 client."""
    moto_s3.create_bucket(Bucket=BUCKET)
    return moto_s3


def store(prefix: str = "run", **config) -> CheckpointStore:
    return CheckpointStore(f"s3://{BUCKET}/{prefix}", keep=2, notify=lambda message: None, config=S3Config(**config))


def saved(checkpoints: CheckpointStore, *steps: int, size: int = 1000) -> CheckpointStore:
    for step in steps:
        checkpoints.save(step, {"weights": Tensor(step, size)})
    return checkpoints


def loaded(checkpoints: CheckpointStore) -> tuple[int | None, float | None]:
    part = Tensor(-1)
    step = checkpoints.load({"weights": part}, clean=False)
    return step, (float(part.tensor[0]) if step is not None else None)


def test_locations_parse_and_refuse():
    assert location("runs/a") == __import__("pathlib").Path("runs/a")
    assert location("s3://bucket-1/a/b/") == S3Location("bucket-1", "a/b")
    assert str(location("s3://bucket-1/a") / "step-00000001.pth") == "s3://bucket-1/a/step-00000001.pth"
    for bad in ("s3://B/a", "s3://bucket/a//b", "s3://bucket/../a"):
        with pytest.raises(UserError):
            location(bad)
    with pytest.raises(UserError, match="credentials go in the AWS chain"):
        S3Config(endpoint="http://key:secret@127.0.0.1:9000")


def test_save_commits_last_and_keep_deletes_only_older(s3):
    checkpoints = saved(store(), 1, 2, 3)
    names = sorted(entry["Key"] for entry in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    lease = ["run/.exactresume.lease"]  # held while the store writes (s3/lease.py)
    assert names == lease + [f"run/step-0000000{n}.pth{end}" for n in (2, 3) for end in ("", ".commit")]
    assert loaded(checkpoints) == (3, 3.0)
    with local_folder() as folder:  # the object is a plain torch file: the lab's dict with nothing of ours
        state = torch.load(fetch_file(checkpoints.place.objects, checkpoints.path_for(3), folder), weights_only=True)
    assert torch.equal(state["weights"]["tensor"], torch.full((1000,), 3.0)) and state["checkpoint_step"] == 3


@pytest.mark.parametrize("floats", [1000, 3 << 20], ids=["one PUT", "three parts"])
def test_a_save_streamed_into_its_upload_is_the_file_save_sealed_writes(s3, tmp_path, floats):
    objects, target = ObjectStore(S3Config(part_bytes=5 << 20)), location(f"s3://{BUCKET}/run/resume.pth")
    state = {"model": {"weight": torch.arange(floats, dtype=torch.float32)}, "step": 3}
    publish_sealed(objects, target, state)
    save_sealed(tmp_path / "resume.pth", state)
    written = (tmp_path / "resume.pth").read_bytes()
    assert s3.get_object(Bucket=BUCKET, Key="run/resume.pth")["Body"].read() == written
    commit = torch.load(io.BytesIO(s3.get_object(Bucket=BUCKET, Key="run/resume.pth.commit")["Body"].read()))
    assert commit["files"] == {"resume.pth": xxhash.xxh3_128_hexdigest(written)}
    assert commit["bytes"] == {"resume.pth": len(written)}
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


def test_a_stream_of_unknown_size_grows_its_parts_to_stay_within_s3s_ten_thousand(s3, monkeypatch):
    capacity = sum(s3_upload.stream_part_bytes(16 << 20, number) for number in range(1, s3_upload.MAX_PARTS + 1))
    assert capacity > 5 << 40  # 10,000 parts from 16 MiB hold more than S3's largest object, 5 TiB
    monkeypatch.setattr(s3_upload, "PARTS_PER_DOUBLING", 1)  # a doubling at every part, to see it here
    sizes, send = [], s3_upload.PartsUpload.send
    monkeypatch.setattr(
        s3_upload.PartsUpload, "send", lambda upload, data: send(upload, data) or sizes.append(len(data))
    )
    objects, target = ObjectStore(S3Config(part_bytes=5 << 20)), location(f"s3://{BUCKET}/run/resume.pth")
    weight = torch.arange(6 << 20, dtype=torch.float32)  # 24 MiB: parts of 5 and 10 MiB, then the rest
    publish_sealed(objects, target, {"weight": weight})
    assert sizes[:2] == [5 << 20, 10 << 20] and len(sizes) == 3
    assert torch.equal(load_committed(objects, target)["weight"], weight)


def test_a_store_that_stops_answering_inside_torch_save_is_its_own_one_line(s3, monkeypatch):
    """torch.save's zip writer turns an error raised by our `write` into a RuntimeError about positions."""
    stopped = StorageError("the object store at AWS S3 did not answer a multipart upload (2 tries)")
    send = s3_upload.PartsUpload.send
    monkeypatch.setattr(
        s3_upload.PartsUpload, "send", lambda upload, data: send(upload, data) if not upload.sent else _raise(stopped)
    )
    objects, target = ObjectStore(S3Config(part_bytes=5 << 20)), location(f"s3://{BUCKET}/run/resume.pth")
    with pytest.raises(StorageError) as raised:
        publish_sealed(objects, target, {"weight": torch.arange(4 << 20, dtype=torch.float32)})
    assert raised.value is stopped
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0


def _raise(error: Exception):
    raise error


def test_uncommitted_objects_are_not_trusted_and_are_cleaned_at_the_next_start(s3):
    checkpoints = saved(store(), 1, 2)
    s3.copy_object(
        Bucket=BUCKET, Key="run/step-00000009.pth", CopySource={"Bucket": BUCKET, "Key": "run/step-00000002.pth"}
    )
    s3.create_multipart_upload(Bucket=BUCKET, Key="run/step-00000010.pth")  # a killed save's upload
    assert [c.step for c in checkpoints.checkpoints()] == [1, 2] and loaded(checkpoints) == (2, 2.0)
    assert [str(p) for p in checkpoints.remove_leftovers()] == [f"s3://{BUCKET}/run/step-00000009.pth"]
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flip", "checksum mismatch against its commit"),
        ("truncate", "truncated or replaced"),
        ("drop-object", "missing, though its commit names it"),
        ("drop-commit", None),  # not listed at all: never committed
        ("damage-commit", "checksum mismatch"),
    ],
)
def test_each_damage_falls_back_to_the_previous_checkpoint(s3, damage, reason):
    notes: list[str] = []
    checkpoints = saved(store(), 1, 2)
    checkpoints.notify = notes.append
    newest = checkpoints.path_for(2)
    key = commit_of(newest).key if damage == "damage-commit" else newest.key
    data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    if damage in ("flip", "damage-commit"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=data[:300] + bytes([data[300] ^ 1]) + data[301:])
    elif damage == "truncate":
        s3.put_object(Bucket=BUCKET, Key=key, Body=data[:-100])
    else:
        s3.delete_object(Bucket=BUCKET, Key=commit_of(newest).key if damage == "drop-commit" else key)
    assert loaded(checkpoints) == (1, 1.0)
    if reason is None:
        assert notes == []
    else:
        assert len(notes) == 1 and reason in notes[0] and str(newest) in notes[0], notes


def test_newest_is_one_paginated_listing_beyond_a_thousand_keys(s3):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    checkpoints = saved(store(), 1, 2)
    server = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]  # 1,001 other objects put behind the API: 50 ms, not 17 s
    for number in range(1001):
        server.put_object(BUCKET, f"run/other-{number:04d}", b"")
    calls = []
    client = checkpoints.place.objects.client
    listing = client.list_objects_v2
    client.list_objects_v2 = lambda **arguments: calls.append(arguments) or listing(**arguments)
    assert [c.step for c in checkpoints.checkpoints()] == [1, 2]
    assert len(calls) == 2 and "ContinuationToken" in calls[1]  # two pages of one listing, no probe per step


def test_multipart_upload_survives_a_failed_part_and_refuses_a_lost_one(s3):
    from botocore.exceptions import ClientError

    checkpoints = saved(store(part_bytes=5 << 20), 1, size=3 << 20)  # 12 MiB: three parts
    client, failures = checkpoints.place.objects.client, []
    upload_part, complete = client.upload_part, client.complete_multipart_upload

    def flaky(**arguments):
        if arguments["PartNumber"] == 2 and not failures:
            failures.append(2)
            raise ClientError(
                {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "UploadPart"
            )
        return upload_part(**arguments)

    client.upload_part = flaky
    saved(checkpoints, 2, size=3 << 20)
    assert failures == [2] and loaded(checkpoints) == (2, 2.0)

    def losing(**arguments):  # the server completes the upload without its second part
        parts = arguments["MultipartUpload"]["Parts"]
        return complete(**arguments | {"MultipartUpload": {"Parts": [parts[0], parts[2]]}})

    client.complete_multipart_upload = losing
    with pytest.raises(StorageError, match="the upload lost bytes"):
        saved(checkpoints, 3, size=3 << 20)
    assert [c.step for c in checkpoints.checkpoints()] == [1, 2] and loaded(checkpoints) == (2, 2.0)


def test_a_server_that_answers_with_its_own_error_is_told_so_not_as_silent(s3):
    """HTTP 500 InternalError at every try (a SeaweedFS out of volumes) was said as "did not answer"."""
    from botocore.exceptions import ClientError

    checkpoints = store(tries=2)

    def failing(**arguments):
        raise ClientError({"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "List")

    checkpoints.place.objects.client.list_objects_v2 = failing
    with pytest.raises(StorageError) as told:
        checkpoints.checkpoints()
    line = str(told.value)
    assert "answered the listing of" in line and "server error (HTTP 500 InternalError; 2 tries" in line, line
    assert "did not answer" not in line


class Requests:
    """Every request a store makes of its object store, with the thread that made it; `down()` makes each
    one fail as a server that stopped listening does, `up()` lets them through again."""

    def __init__(self, checkpoints: CheckpointStore):
        from botocore.exceptions import EndpointConnectionError

        self.made: list[tuple[str, str]] = []
        self.failing = False
        client = checkpoints.places[-1].objects.client
        passed_on = client._make_api_call

        def request(operation: str, arguments: dict):
            self.made.append((operation, threading.current_thread().name))
            if self.failing:
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
            return passed_on(operation, arguments)

        client._make_api_call = request

    def down(self) -> None:
        self.failing = True

    def up(self) -> None:
        self.failing = False


def two_tiers(tmp_path, name: str) -> CheckpointStore:
    config = S3Config(tries=2)  # 0.5 s of backoff a request
    return CheckpointStore(f"s3://{BUCKET}/{name}", local=tmp_path / name, durable_every=2, config=config)


def test_a_two_tier_save_makes_no_request_of_the_durable_tier_on_the_loops_thread(s3, tmp_path):
    """Found by a user: each save listed the bucket on the loop's thread, so a frozen server held every
    step for a request's whole bound. After the first save, only the copies (their own thread) ask it."""
    checkpoints = saved(two_tiers(tmp_path, "listing"), 1, 2)
    checkpoints.wait()
    requests = Requests(checkpoints)
    saved(checkpoints, *range(3, 9))
    checkpoints.wait()
    mine = threading.current_thread().name
    assert requests.made and not [made for made in requests.made if made[1] == mine], requests.made
    checkpoints.close()


def test_a_durable_tier_that_stopped_answering_is_told_once_and_not_asked_again(s3, tmp_path):
    """Found by a user: the copy due with the error's line and the close's last copy each tried the dead
    server for all their tries, and the run ended twice its bound late. A loop that goes on saving once the
    server is back gets its newest step durable at its close."""
    stopping, going_on = two_tiers(tmp_path, "stopping"), two_tiers(tmp_path, "going-on")
    told_at = {}
    for name, checkpoints in (("stopping", stopping), ("going-on", going_on)):
        saved(checkpoints, 1, 2)
        checkpoints.wait()
        requests = Requests(checkpoints)
        requests.down()
        with pytest.raises(StorageError, match="did not answer") as told:
            for step in range(3, 40):
                saved(checkpoints, step)
                time.sleep(0.05)
        assert len(str(told.value).splitlines()) == 1
        told_at[name], asked = step, len(requests.made)
        if name == "stopping":
            checkpoints.close()
            assert len(requests.made) == asked  # neither a copy nor the close asked the dead server again
    requests.up()
    saved(going_on, told_at["going-on"] + 1, told_at["going-on"] + 2)
    going_on.close()
    assert [c.step for c in store("going-on").checkpoints()][-1] == told_at["going-on"] + 2


def test_a_lagging_listing_costs_recency_never_trust(s3):
    checkpoints = saved(store(), 1, 2)
    client = checkpoints.place.objects.client
    listing = client.list_objects_v2

    def lagging(**arguments):  # the newest commit not yet listed
        page = listing(**arguments)
        page["Contents"] = [entry for entry in page["Contents"] if not entry["Key"].endswith("2.pth.commit")]
        return page

    client.list_objects_v2 = lagging
    assert loaded(checkpoints) == (1, 1.0)


def test_errors_name_the_store_never_a_credential(s3):
    with pytest.raises(CheckpointError) as refused:
        from exactresume.store.access import open_resume

        open_resume(f"s3://{BUCKET}/run/resume.pth")
    assert "no such object" in str(refused.value) and MOTO_SECRET not in str(refused.value)
    with pytest.raises(UserError, match="the bucket does not exist"):
        CheckpointStore("s3://no-such-bucket/run").checkpoints()
    checkpoints = saved(store(), 1)
    with local_folder() as folder:
        local = fetch_file(checkpoints.place.objects, checkpoints.path_for(1), folder)
        assert MOTO_SECRET.encode() not in local.read_bytes()
    assert MOTO_SECRET not in os.environ.get("AWS_ENDPOINT_URL", "")


def test_a_sharded_folder_is_read_by_ranged_gets_each_item_verified(s3, monkeypatch):
    from exactresume.store.s3.client import ObjectStore
    from exactresume.store.s3.sharded import load_sharded_s3, save_sharded_s3
    from exactresume.world import World

    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    target = location(f"s3://{BUCKET}/sharded/resume.dcp")
    save_sharded_s3(target, {"model": model, "optimizer": optimizer}, World(), step=5)
    whole, ranges = [], []
    get_file, get_range = ObjectStore.download, ObjectStore.get_range
    monkeypatch.setattr(
        ObjectStore, "download", lambda self, source, path: whole.append(source.name) or get_file(self, source, path)
    )
    monkeypatch.setattr(
        ObjectStore,
        "get_range",
        lambda self, source, start, length: (
            ranges.append((source.name, length)) or get_range(self, source, start, length)
        ),
    )
    state = load_sharded_s3(target)
    assert torch.equal(state["model"]["weight"], model.weight) and state["checkpoint_step"] == 5
    assert sorted(whole) == [".metadata", "commit.pth"]  # the shards only by range, an item a GET
    assert {name for name, _ in ranges} == {"__0_0.distcp"} and all(length > 0 for _, length in ranges)
    key = "sharded/resume.dcp/__0_0.distcp"
    data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=data[:200] + bytes([data[200] ^ 1]) + data[201:])
    with pytest.raises(CheckpointError, match="are damaged"):
        load_sharded_s3(target)


def test_a_sharded_store_on_a_prefix_keeps_cleans_skips_damage_and_resumes(s3):
    """The sharded layout on an object store: each checkpoint a prefix committed by its commit.pth."""
    said: list[str] = []

    def sharded() -> CheckpointStore:
        return CheckpointStore(f"s3://{BUCKET}/run", keep=2, sharded=True, notify=said.append)

    parts = {"weights": Tensor(0, 64)}
    with sharded() as checkpoints:
        for step in (1, 2, 3):
            parts["weights"].tensor.fill_(float(step))
            assert checkpoints.save(step, parts) == location(f"s3://{BUCKET}/run/step-{step:08d}.dcp")
    keys = sorted(entry["Key"] for entry in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert sorted({key.split("/")[1] for key in keys}) == ["step-00000002.dcp", "step-00000003.dcp"]
    assert "run/step-00000003.dcp/commit.pth" in keys
    s3.put_object(Bucket=BUCKET, Key="run/step-00000004.dcp/__0_0.distcp", Body=b"a save killed before its commit")
    shard = next(key for key in keys if key.startswith("run/step-00000003.dcp/") and key.endswith(".distcp"))
    data = s3.get_object(Bucket=BUCKET, Key=shard)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=shard, Body=data[:-1] + bytes([data[-1] ^ 1]))  # the newest one damaged
    resumed = {"weights": Tensor(-1, 64)}
    with sharded() as checkpoints:
        assert checkpoints.load(resumed) == 2
    assert torch.equal(resumed["weights"].tensor, torch.full((64,), 2.0))
    assert len(said) == 1 and "step-00000003.dcp" in said[0] and "damaged" in said[0], said
    left = {entry["Key"] for entry in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert not any(key.startswith("run/step-00000004.dcp/") for key in left)  # cleaned by the writer's load


def test_a_copy_over_the_one_request_limit_goes_in_parts_and_is_byte_identical(s3, monkeypatch):
    from exactresume.store.s3 import client as s3_client

    monkeypatch.setattr(s3_client, "ONE_COPY_LIMIT", 1 << 20)  # as a checkpoint over 5 GiB is copied
    monkeypatch.setattr(s3_client, "COPY_PART", 5 << 20)
    data = os.urandom(12 << 20)  # three parts: 5, 5 and 2 MiB
    s3.put_object(Bucket=BUCKET, Key="run/big", Body=data)
    objects = ObjectStore()
    objects.copy(location(f"s3://{BUCKET}/run/big"), location(f"s3://{BUCKET}/run/big.unreadable"), len(data))
    assert s3.get_object(Bucket=BUCKET, Key="run/big.unreadable")["Body"].read() == data
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
