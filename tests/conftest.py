"""The tests' fixtures: the corpora prepared once per session, a small disk, and S3 servers (SeaweedFS for
real, moto in this process). What tests share besides fixtures is in helpers.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from bench.seaweed import CREDENTIALS
from torch._inductor.runtime import cache_dir_utils

from exactresume.core.data import PrepareConfig, prepare
from exactresume.forkserver import client as forkserver
from helpers import MOTO_SECRET, OFFLINE, TINY_TEXT, once_per_session

os.environ.update(OFFLINE)  # before any test starts a process or a fork server (helpers.OFFLINE)
# torch._dynamo sets this in os.environ the first time it is imported (by a test, at any point), and
# lightning_fabric the next: set from the start, so that the environment the fork servers are kept apart
# by stays one for the session. The test S3 server's credentials likewise, before any server starts.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir_utils.default_cache_dir())
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.update(CREDENTIALS)
# A test process starts runs of more kinds than a user's does (the doctor's, with and without its tracer on
# the path, the frameworks', the trainer's): kept, not closed and started again for each turn of kinds.
forkserver.MAX_SERVERS = 10


# The files that take longest (seconds of one worker), handed out first: xdist gives each worker whole files
# in the order collected (pyproject's --no-loadscope-reorder: else it orders them by their number of tests),
# and a long file handed out last leaves the other worker idle at the end. The S3 files, which wait on
# servers and timeouts, go early, beside files that keep both cores busy (the frameworks' three cases at once).
LONGEST_FIRST = ("test_doctor_frameworks.py", "test_s3_faults.py", "test_lab.py", "test_fsdp.py")
LONGEST_FIRST += ("test_integrations.py", "test_s3_processes.py", "test_doctor_any_python.py", "test_loaders.py")
LONGEST_FIRST += ("test_distributed.py", "test_doctor.py", "test_fault_tolerance.py", "test_s3_lease.py")
LONGEST_FIRST += ("test_s3_protocol.py", "test_s3_takeover.py", "test_s3_train.py", "test_s3_endpoints.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the others keep their order


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_as_in_a_terminal():
    """Ctrl-C as a terminal delivers it: a launcher that started the tests in the background (a shell's
    `&`) hands them SIGINT ignored, and Python keeps an inherited SIG_IGN."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def kjv_folder(tmp_path_factory) -> Path:
    """The default corpus (KJV), prepared once for the whole session (every worker reads it, none writes)."""

    def prepared(folder: Path) -> dict:
        prepare(PrepareConfig(), folder, log=lambda message: None)
        return {"folder": str(folder)}

    return Path(once_per_session(tmp_path_factory, "kjv", prepared)["folder"])


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny prepared corpus whose epochs are a few steps long (see TINY_TEXT)."""
    folder = tmp_path_factory.mktemp("tiny")
    corpus = folder / "tiny.txt"
    corpus.write_text(TINY_TEXT)
    prepare(PrepareConfig(corpus=corpus, vocab_size=270, val_fraction=0.25), folder / "data", log=lambda message: None)
    return folder / "data"


@pytest.fixture
def small_disk(tmp_path):
    """A real 30 MB file system (tmpfs): room for one 20 MB checkpoint, not two or three."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


# ---- object stores (s3://): one SeaweedFS server per test process, a prefix of its bucket per test ----


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server on this machine (bench/seaweed.py), with test credentials in the environment."""
    from bench.seaweed import PORTS, SeaweedServer

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"), PORTS[worker::workers]).start()
    yield server
    server.stop()


@pytest.fixture
def s3_prefix(s3_server) -> str:
    """`s3://BUCKET/PREFIX`: a prefix no other test uses, on the session's server."""
    return s3_server.new_prefix()


@pytest.fixture
def moto_s3(monkeypatch):
    """moto's S3 in this process, with test credentials and no endpoint; yields its boto3 client (no bucket)."""
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "moto-key", "AWS_SECRET_ACCESS_KEY": MOTO_SECRET}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        import boto3

        yield boto3.client("s3")
