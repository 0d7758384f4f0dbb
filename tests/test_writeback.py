"""The disk's writeback started while a checkpoint is written (store/writeback.py): every full piece of a
one-file save and of each file DCP writes is handed to the disk as the next is written, and the bytes
are those written without it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from exactresume.store import writeback
from exactresume.store.dcp_writer import HashingWriter
from exactresume.store.seal_hash import UNKEYED
from exactresume.store.sealed import file_digest, load_sealed, save_sealed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a descriptor's name in /proc")
def test_every_byte_dcp_wrote_is_in_its_file_when_dcp_fsyncs_it(tmp_path, monkeypatch):
    """dcp_writer.py gathers torch.save's small writes in a buffer that DCP's flush after each item leaves
    alone: the descriptor DCP fsyncs must still hold every byte by then."""
    at_fsync, fsync = {}, os.fsync

    def recording(fd: int) -> None:
        at_fsync[Path(os.readlink(f"/proc/self/fd/{fd}")).name.removesuffix(".tmp")] = os.fstat(fd).st_size
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    dcp.save(STATE, storage_writer=HashingWriter(tmp_path, UNKEYED), no_dist=True)
    assert at_fsync == {path.name: path.stat().st_size for path in tmp_path.iterdir()}


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


def test_a_keyed_save_hashes_its_macs_pieces_while_it_writes_and_seals_what_a_whole_read_seals(tmp_path, monkeypatch):
    """store/leaves.py: each whole 8 MiB piece of the keyed MAC is read back and hashed as soon as it is
    written; the seal is the MAC of the whole file all the same (a load under the key verifies it)."""
    from exactresume.store import leaves, sealed
    from exactresume.store.seal_hash import Sealing, keyed

    monkeypatch.setattr(writeback, "PIECE", 1 << 20)
    handed: list[int] = []
    taken = leaves.LeavesAsWritten.into
    monkeypatch.setattr(leaves.LeavesAsWritten, "into", lambda self, mac: handed.append(taken(self, mac)) or handed[-1])
    state = {"weights": torch.randn(5000, 1000)}  # 20 MB: two whole pieces, then a part of one
    with keyed(Sealing(b"a key of 32 bytes, for the test.")):
        save_sealed(tmp_path / "keyed.pth", state)
        assert handed == [2 * leaves.PIECE]  # hashed during the write, before the read-back began
        assert torch.equal(load_sealed(tmp_path / "keyed.pth")["weights"], state["weights"])
        with open(tmp_path / "keyed.pth", "rb") as file:
            assert sealed._recorded_seal(tmp_path / "keyed.pth", file) == sealed._digest(file)  # the MAC read whole
