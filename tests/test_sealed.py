"""The sealed file: a plain torch.save whose seal is checked before a byte is unpickled, read in one pass."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from exactresume.errors import CheckpointError
from exactresume.store import onepass, sealed
from exactresume.store.resume import read_resume_file
from exactresume.store.sealed import load_sealed, save_sealed
from helpers import assert_one_line_error, call_cli

STATE = {
    "format": "x",
    "model": OrderedDict(weight=torch.randn(3, 4), bias=torch.zeros(3, dtype=torch.float64)),
    "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, 4)}}, "param_groups": [{"lr": 1}]},
    "step": 30,
    "gen_state": torch.Generator().manual_seed(7).get_state(),
    "view": torch.arange(10)[2:8:2],
    "empty": torch.empty(0),
}


def test_every_file_we_write_is_read_in_one_pass_as_torch_load_reads_it(tmp_path):
    # Fails the day torch moves the private pieces onepass.py uses: every file would take the slower way.
    path = tmp_path / "state.pth"
    save_sealed(path, STATE)
    with open(path, "rb") as file:
        loaded = onepass.load_verified(path, file, sealed.read_seal(path), sealed.SEAL_LENGTH)
    assert loaded is not onepass.NOT_READ
    plain = torch.load(path, weights_only=True)
    assert list(loaded) == list(plain) == list(STATE)
    assert all(torch.equal(loaded["model"][k], plain["model"][k]) for k in STATE["model"])
    assert torch.equal(loaded["gen_state"], STATE["gen_state"]) and torch.equal(loaded["view"], STATE["view"])
    assert loaded["optimizer"]["state"][0]["step"].item() == 2.0 and loaded["step"] == 30


@pytest.mark.parametrize("reader", ["one pass", "torch.load"])
def test_a_flipped_byte_is_refused_before_anything_is_unpickled(tmp_path, monkeypatch, reader):
    path = tmp_path / "state.pth"
    save_sealed(path, STATE)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    def never(*args, **kwargs):
        raise AssertionError("unpickled before the seal was checked")

    monkeypatch.setattr(onepass, "Unpickler", never)
    if reader == "torch.load":  # a wrapped torch.load (the doctor's) is what reads the file
        monkeypatch.setattr(torch, "load", never)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_sealed(path)


def test_a_packed_file_of_version_2_is_refused_naming_the_release_that_reads_it(tmp_path):
    path = tmp_path / "resume.pth"
    packed = {"format": "exactresume.resume", "version": 2, "layout": "packed", "structure": "{}", "storages": []}
    save_sealed(path, packed)
    with pytest.raises(CheckpointError, match=r"version 2 in the packed layout, which exactresume 0\.2\.0"):
        read_resume_file(path)
    assert_one_line_error(call_cli("inspect", path), "packed layout", "0.2.0")
    assert path.read_bytes()  # nothing of the user's is touched
