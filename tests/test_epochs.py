"""The epoch loader: permutations per epoch, a short last batch, workers that change nothing, and an
O(1) mid-epoch resume that loads no skipped sample."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from exactresume.core import epochs
from exactresume.core.data import load_tokens
from exactresume.core.epochs import EpochLoader, epoch_order, epoch_seed, step_indices
from exactresume.core.permutation import permute, round_keys
from exactresume.errors import CheckpointError

SEQ_LEN, BATCH, SEED = 16, 4, 7


@pytest.fixture(scope="module")
def tokens(tiny_folder):
    return load_tokens(tiny_folder).train


def loader(tokens, workers: int = 0) -> EpochLoader:
    return EpochLoader(tokens, BATCH, SEQ_LEN, SEED, workers)


def indices(batch) -> list[int]:
    return (batch.starts // SEQ_LEN).tolist()


class RecordingSamples(torch.utils.data.Dataset):
    """The loader's dataset, noting every sample index it is asked for (workers 0: in this process)."""

    def __init__(self, inner):
        self.inner, self.loaded = inner, []

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        self.loaded.append(index)
        return self.inner[index]


def test_each_epoch_visits_every_sample_once_with_a_short_last_batch(tokens):
    source = loader(tokens)
    assert len(source.dataset) == 15 and source.steps_per_epoch == 4
    batches = [indices(source.next_batch()) for _ in range(8)]
    assert [len(b) for b in batches] == [4, 4, 4, 3] * 2
    first, second = sum(batches[:4], []), sum(batches[4:], [])
    assert sorted(first) == sorted(second) == list(range(15))
    assert first != second  # each epoch has its own permutation
    assert source.state_dict()["epoch"] == 2 and source.state_dict()["cursor"] == 0


def test_batches_are_the_token_windows_they_name(tokens):
    batch = loader(tokens).next_batch()
    stream = torch.from_numpy(tokens.astype("int64"))
    for row, start in enumerate(batch.starts.tolist()):
        assert torch.equal(batch.inputs[row], stream[start : start + SEQ_LEN])
        assert torch.equal(batch.targets[row], stream[start + 1 : start + SEQ_LEN + 1])


def test_two_workers_deliver_exactly_what_the_main_process_would(tokens):
    in_process, with_workers = loader(tokens, workers=0), loader(tokens, workers=2)
    for _ in range(9):  # across two epoch boundaries
        a, b = in_process.next_batch(), with_workers.next_batch()
        assert torch.equal(a.starts, b.starts) and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_step_indices_is_a_pure_function_of_seed_and_step(tokens):
    source = loader(tokens)
    for step in range(10):
        assert indices(source.next_batch()) == step_indices(SEED, 15, BATCH, step).tolist()


def test_mid_epoch_resume_loads_only_the_samples_it_trains(tokens):
    straight = loader(tokens)
    for _ in range(2):
        straight.next_batch()
    state = straight.state_dict()
    assert (state["epoch"], state["cursor"]) == (0, 2)
    resumed = loader(tokens)
    resumed.load_state_dict(state)
    resumed.dataset = RecordingSamples(resumed.dataset)
    trained = []
    for _ in range(5):  # the rest of epoch 0 (one full and the short batch), then into epoch 1
        expected, got = straight.next_batch(), resumed.next_batch()
        assert torch.equal(expected.starts, got.starts) and torch.equal(expected.inputs, got.inputs)
        trained += indices(got)
    assert resumed.dataset.loaded == trained  # nothing fast-forwarded, no skipped sample loaded
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize(
    "change, needle",
    [({"permutation_seed": 12345}, "permutation seed"), ({"cursor": 4}, "cursor 4"), ({"batch": 5}, "batches of 5")],
)
def test_a_state_from_another_run_is_refused(tokens, change, needle):
    state = loader(tokens).state_dict() | change
    with pytest.raises(CheckpointError, match=needle):
        loader(tokens).load_state_dict(state)


def test_an_epoch_within_the_limit_keeps_the_randperm_order_of_earlier_releases():
    assert epochs.PERMUTATION_LIMIT == 1 << 24
    expected = torch.randperm(1000, generator=torch.Generator().manual_seed(epoch_seed(SEED, 3)))
    assert torch.equal(epoch_order(SEED, 3, 1000).take(0, 1000), expected)


@pytest.mark.parametrize("count", [1, 2, 3, 17, 1000, 4099])
def test_the_large_epoch_order_is_a_permutation(count):
    values = permute(np.arange(count, dtype=np.uint64), count, round_keys(99)).tolist()
    assert sorted(values) == list(range(count))
    assert count < 17 or values != sorted(values)


def test_hundreds_of_millions_of_samples_need_no_epoch_sized_memory(monkeypatch):
    samples = 400_000_000  # a randperm of them would be 3.2 GB
    tokens = np.broadcast_to(np.zeros(1, dtype=np.uint16), (samples * SEQ_LEN + 1,))  # no memory either
    monkeypatch.setattr(torch, "randperm", None)
    tracemalloc.start()
    try:
        straight = EpochLoader(tokens, BATCH, SEQ_LEN, SEED)
        batches = [indices(straight.next_batch()) for _ in range(3)]
        resumed = EpochLoader(tokens, BATCH, SEQ_LEN, SEED)
        resumed.load_state_dict(straight.state_dict() | {"cursor": 2})
        again = indices(resumed.next_batch())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, f"{peak / 1e6:.1f} MB"
    flat = sum(batches, [])
    assert len(set(flat)) == 3 * BATCH and all(0 <= index < samples for index in flat)
    assert again == batches[2] == step_indices(SEED, samples, BATCH, 2).tolist()
    assert straight.state_dict() == resumed.state_dict() and straight.state_dict()["samples"] == samples


def test_random_windows_draw_from_a_memory_mapped_stream_larger_than_ram(tmp_path):
    from exactresume.core.batches import RandomWindows
    from exactresume.core.tokenfile import HEADER_BYTES, npy_header, open_tokens

    count, path = 5 * 10**9, tmp_path / "huge.npy"  # 10 GB of tokens, as a sparse file: no disk used
    with open(path, "wb") as file:
        file.write(npy_header(np.uint16, count))
        file.truncate(HEADER_BYTES + 2 * count)
        file.seek(HEADER_BYTES + 2 * (count - 3))
        file.write(np.array([5, 6, 7], dtype="<u2").tobytes())
    stream = open_tokens(path)
    assert len(stream) == count and stream[-3:].tolist() == [5, 6, 7]
    tracemalloc.start()
    try:
        windows = RandomWindows(stream, BATCH, SEQ_LEN, SEED)
        batch = windows.next_batch()
        inputs, targets = windows.windows(torch.tensor([count - SEQ_LEN - 1]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000 and batch.inputs.dtype == torch.int64
    assert int(batch.starts.max()) > 2**32  # offsets beyond any 32-bit index
    assert targets[0, -3:].tolist() == [5, 6, 7] and inputs[0, -2:].tolist() == [5, 6]
