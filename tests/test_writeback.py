"""The disk's writeback started while a checkpoint is written (store/writeback.py): every full piece of a
one-file save and of each file DCP writes is handed to the disk as the next is written, and the bytes
are those written without it."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from exactresume.store import writeback
from exactresume.store.dcp_writer import HashingWriter
from exactresume.store.seal_hash import UNKEYED
from exactresume.store.sealed import file_digest, load_sealed, save_sealed

STATE = {"weights": torch.randn(700, 1000), "moments": {"step": torch.tensor(3.0), "n": 7}}  # 2.8 MB


@pytest.fixture
def started(monkeypatch) -> list[tuple[int, int, int]]:
    """Every range whose writeback is started, as (fd, offset, length); pieces of 1 MB."""
    ranges: list[tuple[int, int, int]] = []

    def start(fd: int, offset: int, length: int, flags: int) -> int:
        assert flags == writeback.START_WRITE
        ranges.append((fd, offset, length))
        return 0

    monkeypatch.setattr(writeback, "PIECE", 1 << 20)
    monkeypatch.setattr(writeback, "_START", start)
    return ranges


def consecutive(ranges: list[tuple[int, int, int]]) -> bool:
    return all(offset + length == ranges[i + 1][1] for i, (_, offset, length) in enumerate(ranges[:-1]))


def test_a_one_file_save_hands_each_full_piece_to_the_disk_as_it_writes(tmp_path, started):
    save_sealed(tmp_path / "state.pth", STATE)
    assert len(started) == 2 and len({fd for fd, _, _ in started}) == 1  # 2.8 MB: two full pieces, one file
    assert started[0][1] == 0 and consecutive(started) and all(length >= 1 << 20 for _, _, length in started)
    loaded = load_sealed(tmp_path / "state.pth")  # its seal verifies: the bytes are the ones hashed
    assert torch.equal(loaded["weights"], STATE["weights"]) and loaded["moments"]["n"] == 7


def test_each_file_dcp_writes_hands_its_pieces_to_the_disk_and_keeps_its_checksum(tmp_path, started):
    writer = HashingWriter(tmp_path, UNKEYED)
    dcp.save(STATE, storage_writer=writer, no_dist=True)
    assert len(started) == 2 and started[0][1] == 0 and consecutive(started)
    assert writer.digests == {path.name: file_digest(path) for path in tmp_path.iterdir()}


def test_a_writeback_that_fails_leaves_the_save_to_its_fsync(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "PIECE", 1 << 20)
    monkeypatch.setattr(writeback, "_START", lambda fd, offset, length, flags: -1)  # as EINVAL would return
    save_sealed(tmp_path / "state.pth", STATE)
    assert torch.equal(load_sealed(tmp_path / "state.pth")["weights"], STATE["weights"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_c_librarys_sync_file_range_is_called_as_declared(tmp_path):
    with open(tmp_path / "file", "wb") as file:
        file.write(b"x" * 8192)
        file.flush()
        assert writeback._START(file.fileno(), 0, 8192, writeback.START_WRITE) == 0
        assert writeback._START(-1, 0, 8192, writeback.START_WRITE) == -1  # a bad descriptor: told, not raised
