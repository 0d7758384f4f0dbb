"""ResumableStream: a Hugging Face streaming dataset as a part, resumed exactly in new processes, more
than once, where the dataset's own state_dict() is not exact (a shuffle buffer); bad input refused."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from exactresume import CheckpointError, CheckpointStore, GeneratorPart, ResumableStream, UserError
from helpers import one_torch_thread, run_python

datasets = pytest.importorskip("datasets")

PROGRAM = Path(__file__).parent / "loader_programs" / "hf_train.py"
# 3 shards of 8 examples, batches of 4: an epoch is steps 1-6, 7-12, 13-18, its last batch full.
SHARDS, ROWS = 3, 8


def write_shards(folder: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """jsonl shards a streaming dataset reads: ids shard*100+i, 8 features, a class label."""
    folder.mkdir(parents=True)
    draw = random.Random(seed)
    for shard in range(SHARDS):
        lines = [
            json.dumps({"id": shard * 100 + i, "x": [draw.uniform(-1, 1) for _ in range(8)], "y": draw.randrange(4)})
            for i in range(rows)
        ]
        (folder / f"part-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def finished(out: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    """A run's log of steps (each with its example ids) and its final weights."""
    return (out / "batches.jsonl").read_text().splitlines(), torch.load(out / "weights.pth", weights_only=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("hf-stream") / "data")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """The uninterrupted run of each kind, once per module, in this process (datasets is imported already)."""
    spec = importlib.util.spec_from_file_location("hf_train", PROGRAM)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    runs = {}

    def run(kind: str):
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"straight-{kind}")
            with one_torch_thread():
                program.main(data, out, kind, 0)
            runs[kind] = finished(out)
        return runs[kind]

    return run


@pytest.mark.parametrize(
    ("kind", "stops"),
    [
        # A shuffle buffer, resumed by replay: stopped mid-epoch, at epoch 0's last batch (a full one: the
        # epoch has not rolled over), after epoch 1's first batch; each time in a new process.
        ("shuffled", [3, 6, 7]),
        ("plain", [4, 9]),  # no shuffle buffer: resumed from the dataset's own state, twice (datasets #8308)
    ],
)
def test_a_run_stopped_and_resumed_again_and_again_in_new_processes_ends_as_the_straight_run(
    data, straight, tmp_path, kind, stops
):
    for stop in [*stops, 0]:
        ran = run_python(PROGRAM, data, tmp_path, kind, stop, preload=("datasets",))
        assert ran.returncode == 0, ran.stdout
    steps, weights = finished(tmp_path)
    straight_steps, straight_weights = straight(kind)
    assert len(straight_steps) == 3 * SHARDS * ROWS // 4  # three epochs of 4-example batches
    assert steps == straight_steps  # every step's examples, in order, each step once
    assert weights.keys() == straight_weights.keys()
    for name, tensor in straight_weights.items():
        assert torch.equal(weights[name], tensor), name
    saved = torch.load(sorted((tmp_path / "checkpoints").glob("*.pth"))[-1], weights_only=True)["data"]
    assert (saved["native"] is not None) == (kind == "plain")  # a shuffle buffer is resumed by replay


def shuffled(rows: int = SHARDS * ROWS, seed: int = 5, buffer_size: int = 6, offset: int = 0):
    """A streaming dataset of `rows` ids from `offset`, in 3 shards, behind a shuffle buffer."""
    dataset = datasets.Dataset.from_dict({"id": [offset + i for i in range(rows)]}).to_iterable_dataset(SHARDS)
    return dataset.shuffle(seed, buffer_size=buffer_size)


def ids(examples) -> list[int]:
    return [example["id"] for example in examples]


def read(stream: ResumableStream, count: int) -> list[int]:
    iterator = iter(stream)
    return [next(iterator)["id"] for _ in range(count)]


def test_the_datasets_own_state_with_a_shuffle_buffer_is_not_exact_and_the_part_is():
    whole = ids(shuffled())
    dataset = shuffled()
    iterator = iter(dataset)
    head = [next(iterator)["id"] for _ in range(9)]
    resumed = shuffled()
    resumed.load_state_dict(dataset.state_dict())
    native_tail = ids(resumed)
    assert head + native_tail != whole  # silently: no error, the buffer's examples lost and the order changed
    assert len(head + native_tail) < len(whole)

    stream = ResumableStream(shuffled())
    assert read(stream, 9) == head
    state = stream.state_dict()
    again = ResumableStream(shuffled())
    again.load_state_dict(state)
    assert head + ids(again) == whole
    assert again.epoch == 1 and again.consumed == 0


def test_a_stream_read_by_dataloader_workers_refuses_to_save_in_one_line():
    stream = ResumableStream(shuffled())
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2)
    next(iter(loader))
    with pytest.raises(CheckpointError, match="num_workers=0") as refused:
        stream.state_dict()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        (lambda: shuffled(seed=6), "shuffle seed saved"),
        (lambda: shuffled(buffer_size=12), "shuffle buffer_size saved '6', given '12'"),
        (lambda: shuffled(rows=SHARDS * ROWS - 9), "epoch 0 of the dataset now ends after 15 examples"),
        (lambda: shuffled(offset=1000), "the first 20 examples of epoch 0 differ"),
    ],
    ids=["another seed", "another buffer size", "fewer examples", "other examples"],
)
def test_a_dataset_that_changed_since_the_save_is_refused_in_one_line_and_nothing_moves(changed, named):
    saved = ResumableStream(shuffled())
    read(saved, 20)
    state = saved.state_dict()
    stream = ResumableStream(changed())
    before = read(stream, 2)
    with pytest.raises(CheckpointError, match=named) as refused:
        stream.load_state_dict(state)
    assert "\n" not in str(refused.value)
    assert (stream.epoch, stream.consumed) == (0, 2)
    assert before + read(stream, 3) == ids(changed())[:5]  # it reads on where it was


def test_a_state_of_another_kind_is_refused(tmp_path):
    with pytest.raises(UserError, match="takes a datasets.IterableDataset, got a Dataset$"):
        ResumableStream(datasets.Dataset.from_dict({"id": [1, 2]}))  # a map-style dataset: not a stream
    stream = ResumableStream(shuffled())
    for other in (GeneratorPart(torch.Generator()).state_dict(), {"epoch": 0, "consumed": 3}):
        with pytest.raises(CheckpointError, match="is not a ResumableStream's"):
            stream.load_state_dict(other)
    model = torch.nn.Linear(2, 2)
    CheckpointStore(tmp_path / "run").save(1, {"model": model, "data": GeneratorPart(torch.Generator())})
    fresh = torch.nn.Linear(2, 2)
    weights = {name: tensor.clone() for name, tensor in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match="is not a ResumableStream's"):
        CheckpointStore(tmp_path / "run").load({"model": fresh, "data": stream})
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, weights[name]), name  # nothing restored halfway


def test_a_refused_load_after_a_load_leaves_the_first_load_in_place():
    def plain():
        return datasets.Dataset.from_dict({"id": list(range(SHARDS * ROWS))}).to_iterable_dataset(SHARDS)

    whole = ids(plain())
    saved = ResumableStream(plain())
    read(saved, 3)
    state = saved.state_dict()
    assert state["native"] is not None  # no shuffle buffer: the dataset's own state resumes it
    stream = ResumableStream(plain())
    stream.load_state_dict(state)
    forged = state | {"native": None, "digest": "0" * 32}  # replayed, and its examples are not these
    with pytest.raises(CheckpointError, match="the first 3 examples of epoch 0 differ"):
        stream.load_state_dict(forged)
    assert ids(stream) == whole[3:]
