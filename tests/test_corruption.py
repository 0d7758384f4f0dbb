"""Damaged checkpoints, at random: every reader refuses each one with one line, exit 2, and writes nothing.

A flipped bit, a zeroed range, a truncation or bytes appended, each at a random place (seeded), in a
resume file and in each file of a sharded folder (a shard, DCP's index, the commit marker), given to
`inspect`, `diff` and `train --resume`. The readers are run in this process: the claim is about
refusals, not about exactness. And a file cut short by every length that takes its seal, then the zip
end record, is refused by every reader in the same whole line.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import pytest

from exactresume.errors import CheckpointError
from exactresume.store.access import open_resume, read_resume
from exactresume.store.sealed import SEAL_LENGTH
from exactresume.store.weights import read_weights, save_weights
from helpers import SMALL, assert_one_line_error, call_cli

KINDS = ("flip", "zero", "truncate", "append")
TARGETS = ("resume.pth", "resume.dcp/__0_0.distcp", "resume.dcp/.metadata", "resume.dcp/commit.pth")
PER_TARGET = 8  # two of each kind


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, kjv_folder) -> Path:
    """A small run stopped at step 3: resume.pth, and the same state as a sharded folder, resume.dcp."""
    folder = tmp_path_factory.mktemp("stopped")
    for flags in (["--stop-at", 3], ["--stop-at", 3, "--sharded", "--overwrite"]):  # its log over the first's
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


CUTS = range(1, 65)  # every cut that takes part of the seal (53 bytes), then the zip end record after it
CUT_SHORT = re.compile(
    r"(?P<path>.+): damaged, truncated: (its last \d+ bytes are missing \(of the exactresume checksum at its end\)"
    r"|the end of its zip archive is missing)"
)


def cli_refusal(*args: object) -> str:
    """The one line an `exactresume` command refused with (exit 2), less its `exactresume CMD: error: `."""
    finished = call_cli(*args)
    assert_one_line_error(finished)
    return finished.stderr.strip().partition(": error: ")[2]


def library_refusal(read, path: Path) -> str:
    with pytest.raises(CheckpointError) as refused:
        read(path)
    return str(refused.value)


def assert_cut_short(path: Path, lines: list[str]) -> None:
    """Every reader refused `path` in the same whole line, saying it is truncated."""
    assert len(set(lines)) == 1, lines
    found = CUT_SHORT.fullmatch(lines[0])
    assert found and found["path"] == str(path), lines[0]


def cut_copies(good: Path, copy: Path):
    """`copy` holding `good` less its last `cut` bytes, for each cut in CUTS (shortened in place: one write)."""
    shutil.copyfile(good, copy)
    for cut in CUTS:
        os.truncate(copy, good.stat().st_size - cut)
        yield cut


def test_a_resume_file_cut_short_by_any_length_is_damaged_for_every_reader(stopped, tmp_path, kjv_folder):
    good, path = stopped / "resume.pth", tmp_path / "cut.pth"
    for cut in cut_copies(good, path):
        lines = [cli_refusal("inspect", path), cli_refusal("diff", path, good)]
        lines += [library_refusal(read_resume, path), library_refusal(open_resume, path)]
        if cut in (1, SEAL_LENGTH + 1):  # the seal cut, then the end record: a run refuses it before it starts
            lines.append(
                cli_refusal("train", "--out", tmp_path / "out", "--data", kjv_folder, *SMALL, "--resume", path)
            )
        assert_cut_short(path, lines)


def test_a_weights_file_cut_short_by_any_length_is_damaged_for_every_reader(stopped, tmp_path):
    good, path = tmp_path / "weights.pth", tmp_path / "cut.pth"
    save_weights(good, read_weights(stopped / "resume.pth")[0])
    for _ in cut_copies(good, path):
        lines = [cli_refusal("inspect", path), cli_refusal("diff", path, good), library_refusal(read_weights, path)]
        assert_cut_short(path, lines)
