"""Crafted sharded folders: a payload in DCP's `.metadata` or in one of its values never runs, and a name,
a size or an index read from the folder that reaches outside it is refused before anything is allocated.

DCP reads `.metadata` with plain pickle; exactresume reads it through an allow-list of DCP's own
record types. The folders here are sealed properly (their commit marker lists the evil file's
checksum), so only the allow-list stands between the payload and `os.system`.
"""

from __future__ import annotations

import builtins
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from exactresume.store.sharded import COMMIT, write_commit
from helpers import SMALL, assert_one_line_error, call_cli


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


# -- crafted folders: every name and size read from the folder is held to the folder ------------------


def crafted(sharded: Path, tmp_path: Path, change) -> Path:
    """A copy of `sharded` whose DCP index `change(metadata)` rewrote, committed with right checksums."""
    from exactresume.store.dcp_index import read_metadata

    folder = Path(shutil.copytree(sharded, tmp_path / "crafted.dcp"))
    metadata = read_metadata(folder)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    (folder / COMMIT).unlink()
    write_commit(folder, processes=1)
    return folder


def assert_every_reader_refuses(folder: Path, tmp_path: Path, kjv_folder: Path, *needles: str) -> None:
    out = tmp_path / "out"
    for args in (
        ("train", "--out", out, "--data", kjv_folder, *SMALL, "--resume", folder),
        ("diff", folder, folder),
        ("inspect", folder),
    ):
        assert_one_line_error(call_cli(*args), str(folder), *needles)
    assert not out.exists() or not any(out.iterdir())


def point_outside(metadata) -> None:
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"


def huge_tensor(metadata) -> None:
    key = next(key for key, item in metadata.state_dict_metadata.items() if hasattr(item, "size"))
    metadata.state_dict_metadata[key].size = torch.Size([1 << 40])


def huge_index(metadata) -> None:
    key = next(iter(metadata.planner_data))
    metadata.planner_data[key] = ("optimizer", "param_groups", 1 << 40, "lr")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (point_outside, "names a file its commit marker does not: '../outside.distcp'"),
        (huge_tensor, "its files hold fewer"),
        (huge_index, "is no place in a state"),
    ],
    ids=["relative-path-outside", "huge-tensor", "huge-list-index"],
)
def test_a_crafted_index_is_refused_before_anything_is_allocated(sharded, tmp_path, kjv_folder, change, needle):
    assert_every_reader_refuses(crafted(sharded, tmp_path, change), tmp_path, kjv_folder, needle)


@pytest.mark.parametrize("name", ["../outside", "/etc/hostname", "sub/dir", ""])
def test_a_commit_marker_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path, kjv_folder, name):
    from exactresume.store.sealed import load_sealed, save_sealed

    folder = Path(shutil.copytree(sharded, tmp_path / "crafted.dcp"))
    marker = load_sealed(folder / COMMIT)
    marker["files"][name] = "0" * 32
    save_sealed(folder / COMMIT, marker)
    assert_every_reader_refuses(folder, tmp_path, kjv_folder, "not a file name inside the folder")


def test_a_shard_that_is_a_link_out_of_the_folder_is_refused(sharded, tmp_path, kjv_folder):
    folder = Path(shutil.copytree(sharded, tmp_path / "crafted.dcp"))
    outside = tmp_path / "elsewhere.distcp"
    (folder / "__0_0.distcp").rename(outside)
    (folder / "__0_0.distcp").symlink_to(outside)  # the same bytes: only the link gives it away
    assert_every_reader_refuses(folder, tmp_path, kjv_folder, "__0_0.distcp is not a plain file")


def test_a_payload_in_a_dcp_value_is_refused_and_does_not_run(tmp_path, kjv_folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    marker = tmp_path / "pwned"
    folder = tmp_path / "evil.dcp"
    state = {"format": "exactresume.resume", "version": 3, "checkpoint_step": 1, "step": System(f"touch {marker}")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP assumes one process without a process group: it says so
        dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    write_commit(folder, processes=1)  # its checksums are right: weights_only=True is what refuses the value
    out = tmp_path / "out"
    for args in (("train", "--out", out, "--data", kjv_folder, *SMALL, "--resume", folder), ("diff", folder, folder)):
        assert_one_line_error(call_cli(*args), str(folder), "value step is not plain data (it refers to posix.system")
        assert not marker.exists(), f"{args[0]} ran the payload"
    call_cli("inspect", folder)  # reads the index only: the value is never unpickled
    assert not marker.exists()
