"""The N-independent mode (`--micro-batch`): the same bits on 1, 2 and 4 processes, and resumes across N.

Every training run is a new process; the many-process ones go through `--nproc N` (torchrun), each
start a few seconds, so the module makes nine (and one refused on 4): straight runs on 1, 2 and 4
processes and a stop on 2 with the random windows, resumed on 1 and 4; straight on 1 and a stop on 2
mid-epoch with the epoch loader, resumed on 1, across two epoch boundaries.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from exactresume.config import TrainConfig
from exactresume.errors import UserError
from exactresume.parallel.exact import TreeSum, micro_batch_seed
from exactresume.parallel.split import allowed_process_counts
from exactresume.store.weights import read_weights
from helpers import assert_one_line_error, call_cli, run_cli, train_cli

RANDOM = ["--steps", "6", "--batch", "4", "--seq-len", "16", "--micro-batch", "1", "--dropout", "0.1"]
RANDOM += ["--preset", "tiny"]
# The tiny corpus at --seq-len 17 has 14 samples: epochs of 4, 4, 4 and 2 sequences, 8 steps cross two.
EPOCH = [
    "--steps",
    "8",
    "--batch",
    "4",
    "--seq-len",
    "17",
    "--micro-batch",
    "1",
    "--dropout",
    "0.1",
    "--loader",
    "epoch",
]


def assert_same_bits(a: Path, b: Path) -> None:
    first, second = read_weights(a)[0], read_weights(b)[0]
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def train(out: Path, data: Path, flags: list[str], nproc: int, *extra) -> Path:
    train_cli(out, "--data", data, *flags, "--nproc", nproc, "--progress", "none", *extra, check=True)
    return out


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory, kjv_folder) -> Path:
    folder = tmp_path_factory.mktemp("exact")
    for n in (1, 2, 4):
        train(folder / f"straight{n}", kjv_folder, RANDOM, n)
    train(folder / "stop2", kjv_folder, RANDOM, 2, "--stop-at", 3)
    for n in (1, 4):
        train(folder / f"resumed{n}", kjv_folder, RANDOM, n, "--resume", folder / "stop2" / "resume.pth")
    return folder


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory, tiny_folder) -> Path:
    folder = tmp_path_factory.mktemp("exact-epoch")
    train(folder / "straight1", tiny_folder, EPOCH, 1)
    # Steps 1-6 on 2 processes cross the first epoch's end (its short batch at step 4); 7-8 on 1 the second's.
    train(folder / "stop2", tiny_folder, EPOCH, 2, "--stop-at", 6)
    train(folder / "resumed1", tiny_folder, EPOCH, 1, "--resume", folder / "stop2" / "resume.pth")
    return folder


@pytest.mark.parametrize("n", [2, 4])
def test_whole_runs_on_1_2_and_4_processes_end_with_the_same_bits(random_runs, n):
    assert_same_bits(random_runs / "straight1" / "final.pth", random_runs / f"straight{n}" / "final.pth")
    assert (random_runs / "straight1" / "log.csv").read_text() == (random_runs / f"straight{n}" / "log.csv").read_text()


@pytest.mark.parametrize("n", [1, 4])
def test_stopped_on_2_and_resumed_on_another_n_is_bit_identical(random_runs, n):
    assert_same_bits(random_runs / "straight1" / "final.pth", random_runs / f"resumed{n}" / "final.pth")
    straight = (random_runs / "straight1" / "log.csv").read_text().splitlines()
    resumed = (random_runs / f"resumed{n}" / "log.csv").read_text().splitlines()
    assert resumed == [straight[0]] + straight[4:]  # header, then steps 4-6 as text


def test_the_epoch_loader_across_epoch_boundaries_does_not_depend_on_n(epoch_runs, tiny_folder):
    assert len(read_samples_count(tiny_folder)) == 14  # the premise of EPOCH's comment
    assert_same_bits(epoch_runs / "straight1" / "final.pth", epoch_runs / "resumed1" / "final.pth")


def read_samples_count(data: Path) -> range:
    from exactresume.core.data import load_tokens
    from exactresume.core.epochs import TokenSamples

    tokens = torch.from_numpy(load_tokens(data).train.astype("int64"))
    return range(len(TokenSamples(tokens, 17)))


def test_an_n_that_cannot_split_the_micro_batches_is_refused(tmp_path, kjv_folder, tiny_folder):
    finished = call_cli("train", "--out", tmp_path / "a", "--data", kjv_folder, *RANDOM[:4], "--batch", "6",
                        "--micro-batch", "1", "--nproc", "4")  # fmt: skip
    assert_one_line_error(finished, "--micro-batch 1", "6 micro-batches", "--nproc 1, 3, 6")
    # The epoch's short last batch (2 sequences) cannot be split over 4 processes either.
    finished = run_cli("train", "--out", tmp_path / "b", "--data", tiny_folder, *EPOCH, "--nproc", "4")
    assert finished.returncode == 2 and "a batch of 2 sequences" in finished.stderr, finished.stderr
    assert not (tmp_path / "b" / "final.pth").exists()


def test_a_resume_that_switches_the_mode_is_refused_and_writes_nothing(random_runs, kjv_folder, tmp_path):
    plain = [flag for flag in RANDOM]
    plain[plain.index("--micro-batch") + 1] = "0"
    out = tmp_path / "switch"
    finished = call_cli(
        "train", "--out", out, "--data", kjv_folder, *plain, "--resume", random_runs / "stop2" / "resume.pth"
    )
    assert_one_line_error(finished, "micro_batch")
    assert not out.exists() or not any(out.iterdir())


def test_micro_batch_fields_are_checked():
    with pytest.raises(UserError, match="divide batch 6"):  # field names for a library caller
        TrainConfig(batch=6, micro_batch=4)
    with pytest.raises(UserError, match="leave grad_accum at 1"):
        TrainConfig(batch=8, micro_batch=2, grad_accum=2)


def test_allowed_process_counts():
    assert allowed_process_counts(8) == [1, 2, 4, 8]
    assert allowed_process_counts(6) == [1, 3, 6]
    assert allowed_process_counts(1) == [1]


@pytest.mark.parametrize("count", range(1, 13))
def test_any_allowed_split_of_the_tree_adds_in_the_same_order(count):
    generator = torch.Generator().manual_seed(count)
    leaves = [torch.randn(257, generator=generator) * 10 ** torch.randint(-6, 6, (257,), generator=generator)
              for _ in range(count)]  # fmt: skip
    whole = TreeSum()
    for leaf in leaves:
        whole.add(leaf)
    for n in allowed_process_counts(count)[1:]:
        per_rank, blocks = count // n, TreeSum()
        for rank in range(n):
            block = TreeSum()
            for leaf in leaves[rank * per_rank : (rank + 1) * per_rank]:
                block.add(leaf)
            blocks.add(block.result(), leaves=per_rank)
        assert torch.equal(blocks.result(), whole.result()), n
    if count >= 4:  # the test can fail: adding in arrival order is another sum
        sequential = leaves[0]
        for leaf in leaves[1:]:
            sequential = sequential + leaf
        assert not torch.equal(sequential, whole.result())


def test_micro_batch_seeds_are_distinct_per_step_and_index():
    seeds = {micro_batch_seed(7, step, index) for step, index in itertools.product(range(20), range(20))}
    assert len(seeds) == 400 and micro_batch_seed(7, 3, 1) == micro_batch_seed(7, 3, 1)
