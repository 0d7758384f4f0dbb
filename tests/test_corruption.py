"""Damaged checkpoints, at random: every reader refuses each one with one line, exit 2, and writes nothing.

A flipped bit, a zeroed range, a truncation or bytes appended, each at a random place (seeded), in a
resume file and in each file of a sharded folder (a shard, DCP's index, the commit marker), given to
`inspect`, `diff` and `train --resume`. The readers are run in this process: the claim is about
refusals, not about exactness.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from helpers import SMALL, assert_one_line_error, call_cli

KINDS = ("flip", "zero", "truncate", "append")
TARGETS = ("resume.pth", "resume.dcp/__0_0.distcp", "resume.dcp/.metadata", "resume.dcp/commit.pth")
PER_TARGET = 8  # two of each kind


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, kjv_folder) -> Path:
    """A small run stopped at step 3: resume.pth, and the same state as a sharded folder, resume.dcp."""
    folder = tmp_path_factory.mktemp("stopped")
    for flags in (["--stop-at", 3], ["--stop-at", 3, "--sharded"]):
        assert call_cli("train", "--out", folder, "--data", kjv_folder, *SMALL, "--quiet", *flags).returncode == 0
    return folder


def damage(data: bytes, kind: str, rng: random.Random) -> bytes:
    """`data` with one random damage of `kind`; never the bytes it had."""
    at = rng.randrange(len(data))
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :]
    if kind == "zero":
        end = min(len(data), at + rng.randint(1, 4096))
        if not any(data[at:end]):  # already zeros: zero a range that is not
            at = next(i for i, byte in enumerate(data) if byte)
            end = at + 1
        return data[:at] + bytes(end - at) + data[end:]
    if kind == "truncate":
        return data[:at]
    return data + rng.randbytes(rng.randint(1, 4096))


CASES = [(target, KINDS[i % len(KINDS)], i) for target in TARGETS for i in range(PER_TARGET)]


@pytest.mark.parametrize(("target", "kind", "seed"), CASES, ids=[f"{t}-{k}-{s}" for t, k, s in CASES])
def test_every_reader_refuses_a_damaged_checkpoint(stopped, tmp_path, kjv_folder, target, kind, seed):
    copy = tmp_path / "copy"
    shutil.copytree(stopped, copy, ignore=shutil.ignore_patterns("*.csv", "final.pth"))
    damaged = copy / target
    damaged.write_bytes(damage(damaged.read_bytes(), kind, random.Random(f"{target}{kind}{seed}")))
    checkpoint = copy / target.split("/")[0]
    before = sorted(path.name for path in copy.rglob("*"))
    assert_one_line_error(call_cli("inspect", checkpoint))
    assert_one_line_error(call_cli("diff", checkpoint, stopped / target.split("/")[0]))
    out = tmp_path / "resumed"
    assert_one_line_error(call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--resume", checkpoint))
    assert not (out / "final.pth").exists() and sorted(path.name for path in copy.rglob("*")) == before
