"""A Hugging Face `datasets` streaming `IterableDataset` as a part whose resume is exact.

`ResumableStream(dataset)` owns the epoch: it calls `dataset.set_epoch` at the start of each epoch
and counts the examples the loop consumed in it. Its state is (epoch, examples consumed, a digest of
those examples, a fingerprint of the dataset's pipeline) and, where the dataset's own state resumes
exactly, that state too. A load repositions the stream at once: from the dataset's own state when
it is exact, otherwise by reading the epoch again from its start and dropping the consumed examples
(O(examples consumed in the epoch)), checking that they are the ones the saved run consumed.

The dataset's own `state_dict()` alone is not enough: it does not hold a shuffle buffer's content
(the buffer is refilled from the stream on resume, so the order changes), and from datasets 5.0
until the fix of datasets #8308 a resumed dataset stops tracking its position, so the second resume
starts over.

`datasets` is not imported here: the library does not depend on it, and the dataset is used through
its public methods (`set_epoch`, `state_dict`, `load_state_dict`, iteration), plus a read-only look
at its pipeline to fingerprint it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from exactresume.errors import CheckpointError, FieldError, a_kind_of

KIND, VERSION = "hf_stream", 1
# Pipeline stages whose own state resumes at exactly the next example (checked by hand against
# reading the stream to the same position with datasets 5.2: files, map, filter, select_columns and
# a torch format, one or many shards, split by node). Any other stage (a shuffle buffer,
# interleaving, skip/take) is resumed by replay.
EXACT_STAGES = frozenset(
    {
        "ExamplesIterable",
        "ArrowExamplesIterable",
        "RebatchedArrowExamplesIterable",
        "FormattedExamplesIterable",
        "SelectColumnsIterable",
        "MappedExamplesIterable",
        "FilteredExamplesIterable",
    }
)
# datasets 5.0 brought #8308 (the position is no longer tracked after a resume); 5.2 has its fix and
# is the release whose resume was checked by hand here. Older releases are resumed by replay.
FIRST_EXACT_RELEASE = (5, 2)
WORKERS_REFUSED = (
    "ResumableStream was read in DataLoader worker processes, whose progress the loop's process cannot "
    "count: give its DataLoader num_workers=0 (the recipe in docs/loaders.md)"
)


@dataclass
class StreamState:
    """What a `ResumableStream` saves: a plain dict of it is the part's state."""

    epoch: int  # the epoch being read (set_epoch's argument)
    consumed: int  # examples of that epoch handed to the loop
    digest: str  # blake2b chain over those examples, in order: a replay must meet the same
    dataset: dict[str, str]  # the pipeline's fingerprint (pipeline_fingerprint)
    native: dict | None  # the dataset's own state_dict() when it resumes exactly, else None
    kind: str = KIND
    version: int = VERSION

    @classmethod
    def from_saved(cls, saved: Any) -> StreamState:
        """The saved dict as a StreamState, or a CheckpointError saying what it is instead."""
        if isinstance(saved, Mapping) and {"shape", "consumed"} <= set(saved):
            raise CheckpointError(
                "the saved state is a ResumableLoader's (a DataLoader's position), not a ResumableStream's"
            )
        if not isinstance(saved, Mapping) or saved.get("kind") != KIND:
            kind = f" of kind {saved.get('kind')!r}" if isinstance(saved, Mapping) else ""
            raise CheckpointError(f"the saved state is not a ResumableStream's: it is a {type(saved).__name__}{kind}")
        if saved.get("version") != VERSION:
            raise CheckpointError(f"a ResumableStream state of version {saved.get('version')}, this reads {VERSION}")
        missing = [field.name for field in fields(cls) if field.name not in saved]
        if missing:
            raise CheckpointError(f"the saved ResumableStream state lacks {', '.join(missing)}")
        return cls(**{field.name: saved[field.name] for field in fields(cls)})


class ResumableStream(torch.utils.data.IterableDataset):
    """A streaming `datasets.IterableDataset` as a part: iterate it for one epoch, save it, resume it exactly.

    `for epoch in range(stream.epoch, epochs): for batch in DataLoader(stream, batch_size=B)` (num_workers=0).
    """

    def __init__(self, dataset: Any):
        if isinstance(dataset, ResumableStream):
            raise FieldError(
                "ResumableStream takes a datasets.IterableDataset, got one already wrapped: wrap it once", "dataset"
            )
        if not all(callable(getattr(dataset, name, None)) for name in ("set_epoch", "state_dict", "load_state_dict")):
            raise FieldError(f"ResumableStream takes a datasets.IterableDataset, got {a_kind_of(dataset)}", "dataset")
        self.dataset = dataset
        # split_dataset_by_node gives each rank its own shards, so each rank keeps its own position.
        self.per_rank = getattr(dataset, "_distributed", None) is not None
        self.epoch, self.consumed, self._digest = 0, 0, ""
        self._live: Iterator | None = None  # the dataset's iterator over this epoch, `consumed` examples in
        self._native_exact = _native_is_exact(dataset)
        self._native_loaded = False  # the dataset holds a state we gave it, to clear before a fresh epoch
        self._native_unread: dict | None = None  # the state loaded, until the dataset reads from it
        self._native_tracks = True  # the dataset's own state follows `_live` (not a refused replay's reading)
        # Shared memory: a DataLoader worker that reads this stream marks it where the loop's process sees it.
        self._read_in_worker = torch.zeros((), dtype=torch.int8).share_memory_()

    def __iter__(self) -> Iterator:
        """The rest of this epoch's examples; when they run out, the next epoch starts (for the next loop)."""
        if torch.utils.data.get_worker_info() is not None:
            self._read_in_worker.fill_(1)  # the save refuses, in one line (WORKERS_REFUSED)
        if self._live is None:
            self._live = self._open_fresh_epoch()
        for example in self._live:
            self._native_unread = None  # the dataset's own state tracks the position from here
            self.consumed += 1
            self._digest = _chained(self._digest, example)
            yield example
        self._live = None
        self.epoch, self.consumed, self._digest = self.epoch + 1, 0, ""

    def __getstate__(self) -> dict:
        # A DataLoader worker started by spawn gets a pickled copy: the live iterator (a generator) stays here.
        return self.__dict__ | {"_live": None}

    def state_dict(self) -> dict:
        """The position of the loop in the stream (a plain dict: weights_only loads it)."""
        if int(self._read_in_worker):
            raise CheckpointError(WORKERS_REFUSED)
        native = self._native_unread
        if native is None and self.consumed and self._native_exact and self._native_tracks:
            native = self.dataset.state_dict()
            native = native if native.get("epoch") == self.epoch else None  # read elsewhere since: replay
        state = StreamState(self.epoch, self.consumed, self._digest, _pipeline_fingerprint(self.dataset), native)
        return asdict(state)

    def load_state_dict(self, state: Mapping) -> None:
        """Position the stream where `state` was saved; a CheckpointError (nothing changed) if the dataset differs."""
        saved = StreamState.from_saved(state)
        _check_same_dataset(saved.dataset, _pipeline_fingerprint(self.dataset))
        if saved.consumed == 0:
            live = None  # the epoch starts fresh at the next iteration
            self._forget_native()
        elif saved.native is not None and self._native_exact:
            live = self._open_native(saved)
        else:
            live = self._replay(saved)
        self.epoch, self.consumed, self._digest, self._live = saved.epoch, saved.consumed, saved.digest, live

    def _open_fresh_epoch(self) -> Iterator:
        self._forget_native()
        self._native_tracks = True
        self.dataset.set_epoch(self.epoch)
        return iter(self.dataset)

    def _forget_native(self) -> None:
        """A state we loaded into the dataset (then replaced, or put back) must not apply to its next read."""
        if self._native_loaded:
            self.dataset.load_state_dict(None)
            self._native_loaded, self._native_unread = False, None

    def _open_native(self, saved: StreamState) -> Iterator:
        self.dataset.set_epoch(saved.epoch)
        self.dataset.load_state_dict(saved.native)
        self._native_loaded, self._native_unread, self._native_tracks = True, saved.native, True
        return iter(self.dataset)

    def _replay(self, saved: StreamState) -> Iterator:
        """The epoch read again from its start, `saved.consumed` examples in; refused, the dataset as it was."""
        pending = self._native_unread
        self._forget_native()
        try:
            live = self._read_to(saved)
        except CheckpointError:
            # The loop may read on from where it was: the dataset's epoch and a state not yet read go back.
            self.dataset.set_epoch(self.epoch)
            if pending is not None:
                self.dataset.load_state_dict(pending)
                self._native_loaded, self._native_unread = True, pending
            self._native_tracks = self._live is None or pending is not None  # else its state is the replay's
            raise
        self._native_tracks = True
        return live

    def _read_to(self, saved: StreamState) -> Iterator:
        """The epoch read from its start, `saved.consumed` examples in, each checked against the digest."""
        self.dataset.set_epoch(saved.epoch)
        live, digest = iter(self.dataset), ""
        for count in range(saved.consumed):
            example = next(live, _END)
            if example is _END:
                raise CheckpointError(
                    f"epoch {saved.epoch} of the dataset now ends after {count} examples, before the saved "
                    f"position {saved.consumed}: the dataset changed since the save"
                )
            digest = _chained(digest, example)
        if digest != saved.digest:
            raise CheckpointError(
                f"the first {saved.consumed} examples of epoch {saved.epoch} differ from those the saved run "
                "consumed: the dataset's content, length or order changed since the save (another dataset, "
                "or a shuffle without seed=)"
            )
        return live


_END = object()


def _native_is_exact(dataset: Any) -> bool:
    """Whether the dataset's own state_dict() resumes at exactly the next example: a known release, and
    every stage of its pipeline one whose resume was checked (EXACT_STAGES)."""
    try:
        release = tuple(int(part) for part in importlib.metadata.version("datasets").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    stages = _pipeline_stages(dataset)
    # datasets' own docs warn that a batched map may skip a batch on resume: replayed instead.
    checked = all(type(stage).__name__ in EXACT_STAGES and not getattr(stage, "batched", False) for stage in stages)
    return release >= FIRST_EXACT_RELEASE and bool(stages) and checked


def _pipeline_stages(dataset: Any) -> list:
    """The example iterables a streaming dataset reads through, outermost first (empty if it has none)."""
    stages, pending = [], [getattr(dataset, "_ex_iterable", None)]
    while pending:
        stage = pending.pop(0)
        if stage is None:
            continue
        stages.append(stage)
        pending += [getattr(stage, "ex_iterable", None), *getattr(stage, "ex_iterables", [])]
    return stages


def _pipeline_fingerprint(dataset: Any) -> dict[str, str]:
    """What decides a streaming dataset's order, field by field: a changed field is named on load."""
    stages = _pipeline_stages(dataset)
    sizes = [str(stage.buffer_size) for stage in stages if hasattr(stage, "buffer_size")]
    generators = [stage.generator for stage in stages if hasattr(stage, "generator")]
    shuffle = hashlib.blake2b(repr([g.bit_generator.state for g in generators]).encode(), digest_size=6)
    distributed = getattr(dataset, "_distributed", None)
    return {
        "pipeline": " > ".join(type(stage).__name__ for stage in stages) or type(dataset).__name__,
        "shards": str(getattr(dataset, "num_shards", "?")),
        "shuffle buffer_size": ", ".join(sizes) or "none",
        "shuffle seed": shuffle.hexdigest() if generators else "none",
        "features": str(getattr(dataset, "features", None)),
        "format": str(getattr(getattr(dataset, "_formatting", None), "format_type", None)),
        "split by node": f"rank {distributed.rank} of {distributed.world_size}" if distributed else "no",
    }


def _check_same_dataset(saved: Mapping[str, str], given: Mapping[str, str]) -> None:
    """A one-line CheckpointError naming each field of the dataset's fingerprint that changed."""
    changed = [
        f"{name} saved {saved.get(name)!r}, given {given[name]!r}" for name in given if saved.get(name) != given[name]
    ]
    if changed:
        raise CheckpointError(f"the dataset changed since the save: {'; '.join(changed)}")


def _chained(previous: str, example: Any) -> str:
    """The digest of the examples so far, `example` last: blake2b(previous digest, example's bytes)."""
    hasher = hashlib.blake2b(previous.encode(), digest_size=16)
    _feed(hasher, example)
    return hasher.hexdigest()


def _feed(hasher: Any, value: Any) -> None:
    """Feed `value`'s content, with its types, to `hasher`: equal examples give equal bytes."""
    if isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"tensor {tensor.dtype} {list(tensor.shape)}:".encode())
        hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    elif hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array or scalar
        hasher.update(f"array {value.dtype} {list(getattr(value, 'shape', ()))}:".encode() + value.tobytes())
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        hasher.update(f"{type(value).__name__} {value!r};".encode())
    else:  # an image or another decoded object: its pickled bytes hold its content
        hasher.update(type(value).__name__.encode() + pickle.dumps(value))
