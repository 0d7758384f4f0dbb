"""A user's training loop over a Hugging Face streaming dataset, resumable with `ResumableStream`.

    python hf_train.py DATA OUT KIND STOP

DATA holds the jsonl shards the test wrote; OUT the checkpoint folder, `batches.jsonl` (one line per
step: the step and its example ids, appended by every process of a run) and `weights.pth` at the end.
KIND is `shuffled` (a shuffle buffer: resumed by replay) or `plain` (resumed from the dataset's own
state). The loop resumes from OUT's newest checkpoint, if any, and stops after step STOP (0: the
whole run) with a checkpoint of that step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch

from exactresume import CheckpointStore, GlobalRng, ResumableStream, StepCounter

EPOCHS, BATCH = 3, 4


def read_shards(files: list[str]):
    """The examples of each jsonl shard in turn: what a streaming dataset of local files yields."""
    for name in files:
        with open(name) as shard:
            yield from (json.loads(line) for line in shard)


def build_dataset(data: Path, kind: str) -> datasets.IterableDataset:
    """The shards of `data` as a streaming dataset (one shard a file); `shuffled` adds a shuffle buffer
    smaller than an epoch."""
    files = sorted(str(path) for path in data.glob("*.jsonl"))
    dataset = datasets.IterableDataset.from_generator(read_shards, gen_kwargs={"files": files})
    if kind == "shuffled":
        dataset = dataset.shuffle(seed=7, buffer_size=8)
    return dataset.with_format("torch")


def main(data: Path, out: Path, kind: str, stop: int) -> None:
    datasets.disable_progress_bars()
    torch.set_num_threads(1)  # the straight run runs in the test's process: the same kernels on both sides
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    stream = ResumableStream(build_dataset(data, kind))
    # A generator of its own: each iter(loader) draws a seed from it, not from the RNG dropout draws from.
    loader = torch.utils.data.DataLoader(stream, batch_size=BATCH, generator=torch.Generator())
    step = StepCounter()
    parts = {"model": model, "optimizer": optimizer, "data": stream, "step": step, "rng": GlobalRng()}
    store = CheckpointStore(out / "checkpoints", keep=2)
    store.load(parts)
    with open(out / "batches.jsonl", "a") as log:
        for _epoch in range(stream.epoch, EPOCHS):
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step.value += 1
                log.write(json.dumps({"step": step.value, "ids": batch["id"].tolist()}) + "\n")
                if step.value == stop:
                    store.save(step.value, parts)
                    return
    torch.save(model.state_dict(), out / "weights.pth")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
