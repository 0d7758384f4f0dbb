"""A sharded folder whose DCP `.metadata` is a pickle carrying a payload is refused, and the payload never runs.

DCP reads `.metadata` with plain pickle; exactresume reads it through an allow-list of DCP's own
record types. The folders here are sealed properly (their commit marker lists the evil file's
checksum), so only the allow-list stands between the payload and `os.system`.
"""

from __future__ import annotations

import builtins
import os
import pickle
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from conftest import SMALL, assert_one_line_error, call_cli
from exactresume.store.sharded import COMMIT, write_commit


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, kjv_folder) -> Path:
    """A one-process run stopped at step 2, its resume state written as a DCP folder."""
    out = tmp_path_factory.mktemp("sharded")
    finished = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--stop-at", 2, "--sharded")
    assert finished.returncode == 0, finished.stderr
    return out / "resume.dcp"


class System:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Exec:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


PAYLOADS = {
    "os.system": (lambda marker: System(f"touch {marker}"), "posix.system"),
    "exec": (lambda marker: Exec(f"open({str(marker)!r}, 'w').close()"), "builtins.exec"),
    # The payload inside a real DCP index, where DCP's own reader would run it while reading the rest.
    "inside-metadata": (
        lambda marker: Metadata(state_dict_metadata={}, planner_data={"model": System(f"touch {marker}")}),
        "posix.system",
    ),
}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_metadata_pickle_payload_is_refused_and_does_not_run(tmp_path, kjv_folder, sharded, payload):
    make, names = PAYLOADS[payload]
    marker = tmp_path / "pwned"
    folder = Path(shutil.copytree(sharded, tmp_path / "evil.dcp"))
    (folder / ".metadata").write_bytes(pickle.dumps(make(marker)))
    (folder / COMMIT).unlink()
    write_commit(folder, processes=1)  # its checksums are right: the allow-list is what refuses it
    out = tmp_path / "out"
    for args in (
        ("train", "--out", out, "--data", kjv_folder, *SMALL, "--resume", folder),
        ("diff", folder, folder),
        ("inspect", folder),
    ):
        finished = call_cli(*args)
        assert not marker.exists(), f"{args[0]} ran the payload"
        assert_one_line_error(finished, str(folder), names)
    assert not out.exists() or not any(out.iterdir())
