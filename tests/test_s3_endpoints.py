"""A wrong `--s3-endpoint` as a user types it: each is one line naming the endpoint and the likely cause.

Nothing here trains: `inspect` of a prefix makes the same first requests a run does (a listing).
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from exactresume import CheckpointStore, save_resume
from exactresume.errors import UserError
from exactresume.store.locations import S3Config
from exactresume.store.s3.client import _refusal
from helpers import assert_one_line_error, call_cli, free_port

PREFIX = "s3://exactresume-tests/endpoints"


@pytest.fixture
def credentials(monkeypatch):
    """Keys the requests are signed with (no server here checks them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "endpoint-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "endpoint-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def inspect(endpoint: str, *extra: object):
    return call_cli("inspect", PREFIX, "--s3-endpoint", endpoint, "--s3-tries", 2, *extra)


def assert_storage_line(finished, *needles: str) -> None:
    """Exit 74 (a storage fault, worth a rerun), one line, no traceback, each needle in it."""
    lines = finished.stderr.strip().splitlines()
    assert finished.returncode == 74 and len(lines) == 1 and "Traceback" not in finished.stderr, finished.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_web_server_that_is_not_s3_is_named(credentials, tmp_path):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        refused = inspect(endpoint)
    finally:
        server.shutdown()
    assert_one_line_error(refused, endpoint, "not as an S3 server", "S3 port")


def test_seaweedfs_filer_port_is_named(s3_server):
    endpoint = f"http://127.0.0.1:{s3_server.filer}"
    assert_one_line_error(inspect(endpoint), endpoint, "not as an S3 server")


def test_a_missing_scheme_is_named(credentials):
    port = free_port()
    assert_one_line_error(inspect(f"127.0.0.1:{port}"), "scheme is missing", f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_the_environments_endpoint_is_held_to_what_the_flag_is(credentials, monkeypatch, variable):
    """boto3 raised its own ValueError (a traceback) for an endpoint from the environment without a scheme."""
    port = free_port()
    monkeypatch.setenv(variable, f"127.0.0.1:{port}")
    refused = call_cli("inspect", PREFIX)
    assert_one_line_error(refused, f"{variable} 127.0.0.1:{port}: the scheme is missing", f"http://127.0.0.1:{port}")
    monkeypatch.setenv(variable, "http://key:hunter2@127.0.0.1:9000")
    refused = call_cli("inspect", PREFIX)
    assert_one_line_error(refused, f"{variable} holds user info")
    assert "hunter2" not in refused.stderr


@pytest.mark.parametrize("typed", ["s3:/bucket/run", "s3:bucket/run", "gs://bucket/run"])
def test_a_location_that_begins_as_another_url_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, typed):
    monkeypatch.chdir(tmp_path)
    for flag in ("--checkpoints", "--out", "--resume"):
        command = ["train", "--out", "out", "--steps", "1", flag, typed] if flag != "--out" else ["train", flag, typed]
        assert_one_line_error(call_cli(*command), f"{typed} begins as a URL", "s3://BUCKET/PREFIX")
    assert not any(tmp_path.iterdir())  # refused as the flags were read: nothing made
    with pytest.raises(UserError, match="begins as a URL"):
        CheckpointStore("s3:/bucket/run")


def test_user_info_is_refused_without_printing_it():
    refused = inspect("http://key:hunter2@127.0.0.1:9000")
    assert_one_line_error(refused, "credentials go in the AWS chain")
    assert "hunter2" not in refused.stderr


def test_a_closed_port_is_named(credentials):
    endpoint = f"http://127.0.0.1:{free_port()}"
    assert_storage_line(inspect(endpoint), endpoint, "nothing listens there", "--resume auto")


def test_a_server_that_accepts_but_never_answers_stops_within_the_bound(credentials):
    """A frozen server's kernel still completes connections: only the read timeout ends each try."""
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(64)  # never accepted: a frozen process's socket
        endpoint = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        started = time.monotonic()
        finished = inspect(endpoint, "--s3-timeout", 1)
        took = time.monotonic() - started
    assert_storage_line(finished, endpoint, "no answer within 1 s", "2 tries", "--resume auto")
    bound = S3Config(tries=2, connect_timeout=1, read_timeout=1).bound()
    assert 2 <= took <= bound + 1, (took, bound)


def test_the_timeout_flag_is_checked():
    assert_one_line_error(inspect("http://127.0.0.1:9", "--s3-timeout", 0), "--s3-timeout")


@pytest.mark.parametrize("code", ["PermanentRedirect", "AuthorizationHeaderMalformed"])
def test_a_wrong_region_is_named(code):
    refusal = _refusal("the listing of s3://bucket/run", code, Exception())
    assert isinstance(refusal, UserError) and "another region" in str(refusal) and "AWS_REGION" in str(refusal)


def test_an_endpoint_no_location_uses_is_said_and_the_command_goes_on(tmp_path):
    save_resume(tmp_path / "resume.pth", {"model": torch.nn.Linear(2, 2)}, step=1)
    shown = call_cli("inspect", tmp_path / "resume.pth", "--s3-endpoint", "http://127.0.0.1:9")
    assert shown.returncode == 0, shown.stderr
    assert (
        shown.stderr
        == "exactresume: --s3-endpoint http://127.0.0.1:9 is unused: no location of this command is s3://BUCKET/PREFIX\n"
    )
