"""`train --checkpoints s3://...` against a real S3 server through kill -9, damaged objects and a server
that stops: what is committed stays trusted, nothing else is, and `--resume auto` ends bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from exactresume.store.faults import FAULT_ENV, OBJECT_STORE_STAGES
from exactresume.store.locations import S3Config
from exactresume.store.numbered import CheckpointStore
from exactresume.store.s3.files import COPY_PREFIX
from helpers import (
    SMALL,
    assert_one_line_error,
    assert_same_run,
    assert_weights_equal,
    call_cli,
    one_torch_thread,
    reference_run,
    run_cli,
    spawn_cli,
)

# Parts of 5 MiB: a checkpoint of the default model (20 MB) goes up as a multipart upload of four.
PARTS = ("--s3-part-mib", "5")
DEFAULT_MODEL = ("--preset", "default")


def train_flags(out: Path, data: Path, endpoint: str | None = None, *extra: object) -> list:
    reach = ["--s3-endpoint", endpoint, *PARTS] if endpoint else []
    flags = [*SMALL, *DEFAULT_MODEL, "--samples", out / "samples.csv", *reach]
    return ["train", "--out", out, "--data", data, *flags, *extra]


def chaos_flags(out: Path, data: Path, endpoint: str | None = None, prefix: str | None = None) -> list:
    where = ["--checkpoints", prefix] if prefix else []
    return train_flags(out, data, endpoint, *where, "--save-every", 1, "--keep", 2, "--resume", "auto")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, kjv_folder) -> Path:
    """The uninterrupted run (local checkpoints; the same steps, logs and weights), in this process."""
    return reference_run(tmp_path_factory, lambda out: chaos_flags(out, kjv_folder))


def committed(endpoint: str, prefix: str) -> list[int]:
    """The steps committed under `prefix`; every one of them must verify, and the newest load."""
    store = CheckpointStore(prefix, keep=None, notify=pytest.fail, config=S3Config(endpoint))
    checkpoints = store.checkpoints()
    assert [c.step for c in checkpoints if not store.verifies(c)] == []
    assert not checkpoints or store.load_newest() is not None
    return [c.step for c in checkpoints]


KILL_POINTS = ["write@1", "upload@1", "upload@2", "upload@3", "upload@4", "commit@1", "retention@1"]


def test_the_kill_points_cover_every_stage_of_an_upload():
    """Every stage of a save to an object store but the snapshot, which happens before any upload."""
    assert {point.split("@")[0] for point in KILL_POINTS} == set(OBJECT_STORE_STAGES) - {"snapshot"}


def test_kill_9_during_uploads_then_resume_auto_is_bit_exact(tmp_path, kjv_folder, reference, s3_server, s3_prefix):
    """9 kills: at each point of a save (the write, each part's upload, the commit, retention) in a random
    order, then at the commit and retention again, late, when older checkpoints are there to prune."""
    out, endpoint, faults = tmp_path / "run", s3_server.endpoint, list(KILL_POINTS)
    random.Random(26).shuffle(faults)
    faults += ["commit@1", "retention@1"]
    for kill, fault in enumerate(faults):
        finished = run_cli(
            *chaos_flags(out, kjv_folder, endpoint, s3_prefix), env={"OMP_NUM_THREADS": "1", FAULT_ENV: fault}
        )
        assert finished.returncode == -signal.SIGKILL, (kill, fault, finished.stderr)
        steps = committed(endpoint, s3_prefix)
        assert len(steps) <= 3 and steps == sorted(steps), (fault, steps)  # keep 2, and a third before retention
    assert len(steps) >= 2, steps  # the late kills met checkpoints to prune
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


def test_inspect_and_diff_of_a_prefix_read_its_newest_verified_checkpoint(s3_server, victim):
    _, prefix = victim
    reach = ("--s3-endpoint", s3_server.endpoint)
    listed = call_cli("inspect", prefix, *reach)
    assert listed.returncode == 0 and "a resume continues from step 4" in listed.stdout, listed.stdout + listed.stderr
    newest = call_cli("diff", prefix, f"{prefix}/step-00000004.pth", *reach)
    assert newest.returncode == 0 and "equal" in newest.stdout, newest.stdout + newest.stderr
    copy = s3_server.new_prefix()
    _copy_prefix(s3_server.client(), prefix, copy)
    damage(s3_server.client(), f"{copy}/step-00000004.pth", "flip")
    listed = call_cli("inspect", copy, *reach, "--json")
    assert listed.returncode == 1, listed.stderr  # shown, but not all verified
    assert [c["status"] for c in json.loads(listed.stdout)["checkpoints"]] == ["verified", "damaged"]
    older = call_cli("diff", copy, f"{prefix}/step-00000002.pth", *reach)
    assert older.returncode == 0 and "equal" in older.stdout, older.stdout + older.stderr
    assert "skipping damaged checkpoint" in older.stderr and "step-00000004.pth" in older.stderr


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


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_server_frozen_or_killed_mid_save_stops_in_one_line_within_the_bound_then_resumes(
    tmp_path, kjv_folder, reference, s3_server, s3_prefix, fault
):
    """SIGSTOP (it accepts connections, never answers) or a kill while a save's parts go up: the run
    stops within S3Config.bound() of the fault, in one line, and `--resume auto` ends bit-identical."""
    out, endpoint = tmp_path / "run", s3_server.endpoint
    env = {"OMP_NUM_THREADS": "1", FAULT_ENV: "upload@9:stop"}  # frozen in its third save's upload
    reach = ("--s3-tries", "2", "--s3-timeout", "2")
    child = spawn_cli(*chaos_flags(out, kjv_folder, endpoint, s3_prefix), *reach, env=env)
    while not _stopped(child.pid) and child.poll() is None:
        time.sleep(0.05)
    if fault == "frozen":
        os.killpg(s3_server.process.pid, signal.SIGSTOP)
    else:
        s3_server.stop()
    started = time.monotonic()
    try:
        child.send_signal(signal.SIGCONT)
        _, stderr = child.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        if fault == "frozen":
            os.killpg(s3_server.process.pid, signal.SIGCONT)
        else:
            s3_server.start()
    assert child.returncode == 74, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert endpoint in lines[0] and "2 tries" in lines[0] and "--resume auto" in lines[0], stderr
    bound = S3Config(tries=2, connect_timeout=2, read_timeout=2).bound()
    assert took <= bound + 2, (took, bound)  # and the process's own exit
    assert committed(endpoint, s3_prefix) == [1, 2]
    finished = run_cli(*chaos_flags(out, kjv_folder, endpoint, s3_prefix), env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0, finished.stderr
    assert_same_run(out, reference)


def test_server_frozen_before_a_run_starts_stops_in_one_line_within_the_bound(tmp_path, kjv_folder, s3_server, victim):
    _, prefix = victim
    flags = train_flags(tmp_path, kjv_folder, s3_server.endpoint, "--checkpoints", prefix, "--resume", "auto")
    os.killpg(s3_server.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        refused = call_cli(*flags, "--s3-tries", 2, "--s3-timeout", 1)
    finally:
        os.killpg(s3_server.process.pid, signal.SIGCONT)
    took = time.monotonic() - started
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 74 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert s3_server.endpoint in lines[0] and "no answer within 1 s" in lines[0] and "--resume auto" in lines[0]
    assert took <= S3Config(tries=2, connect_timeout=1, read_timeout=1).bound() + 1, took


class FreezingProxy:
    """TCP to the server through this process until `after` bytes of its answers have passed, then
    nothing more either way, the connections held open: a server frozen in the middle of an answer."""

    def __init__(self, port: int, after: int):
        self.port, self.left, self.frozen = port, after, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint, self.held = f"http://127.0.0.1:{self.listener.getsockname()[1]}", []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.port))
                self.held += [client, server]
                threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
                threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        with contextlib.suppress(OSError):
            while (data := source.recv(1 << 16)) and not self.frozen.is_set():
                if answers:
                    self.left -= len(data)
                    if self.left < 0:
                        self.frozen.set()
                        return
                sink.sendall(data)

    def close(self) -> None:
        for held in [self.listener, *self.held]:
            held.close()


def test_server_frozen_during_a_load_stops_in_one_line_within_the_bound_then_resumes(
    tmp_path, kjv_folder, reference, s3_server, victim
):
    """The resume's streaming GET stops mid-body: the read timeout ends it, then `--resume auto` goes on."""
    _, prefix = victim
    copy = s3_server.new_prefix()
    _copy_prefix(s3_server.client(), prefix, copy)
    proxy = FreezingProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), after=3 << 20)  # inside the 20 MB checkpoint
    flags = ("--checkpoints", copy, "--save-every", 2, "--resume", "auto")
    try:
        reach = ("--s3-tries", 2, "--s3-timeout", 2)
        child = spawn_cli(*train_flags(tmp_path, kjv_folder, proxy.endpoint, *flags), *reach)
        proxy.frozen.wait(120)
        started = time.monotonic()
        _, stderr = child.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        proxy.close()
    lines = stderr.strip().splitlines()
    assert child.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert proxy.endpoint in lines[0] and "within 2 s" in lines[0] and "--resume auto" in lines[0], stderr
    assert took <= S3Config(tries=2, connect_timeout=2, read_timeout=2).bound() + 2, took
    finished = run_cli(*train_flags(tmp_path, kjv_folder, s3_server.endpoint, *flags), env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0 and f"resumed from {copy}/step-00000004.pth" in finished.stdout, finished.stderr
    assert_weights_equal(tmp_path / "final.pth", reference / "final.pth")
