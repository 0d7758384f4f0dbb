"""Random numbers drawn inside a loader's workers, seen as they are drawn.

A worker's RNGs (torch's, python's `random`, numpy's global one) are seeded when the worker starts and
move with every sample it reads; they live in the worker process, so no part can save them. A dataset
that draws from them in `__getitem__` (random augmentation), or a collate function that does (a
masking collator), gives a run resumed mid-epoch other draws than the straight run's. `WatchedDataset`
stands in for a map-style dataset in the workers, and `WatchedCollate` for its collate function; each
compares those RNGs before and after a worker's first fetches, and the first move it sees sets a flag
in shared memory that the loop's process reads. Reading the three states costs about 0.15 ms a fetch, so
each worker checks its first WATCHED fetches only: a dataset that draws at all draws from the first
(a random choice of whether to augment is a draw too), and then fetches pass through untouched.
"""

from __future__ import annotations

import random
import sys

import torch
from torch.utils.data import Dataset, get_worker_info

WATCHED = 16  # fetches each worker (each copy of the dataset in a worker process) checks


class DrawFlag:
    """One byte in shared memory: whether any worker of a loader has drawn from its RNGs while fetching."""

    def __init__(self):
        self.byte = torch.zeros(1, dtype=torch.uint8).share_memory_()  # workers started later share it

    def seen(self) -> bool:
        return bool(self.byte[0])

    def set(self) -> None:
        self.byte[0] = 1


def _rng_states() -> tuple:
    numpy = sys.modules.get("numpy")  # a dataset that draws from numpy has imported it
    # the key array and the position in it: a draw moves the position, the keys only every 624 words
    numpy_state = None if numpy is None else _numpy_state(numpy.random.get_state())
    return torch.get_rng_state(), random.getstate(), numpy_state


def _numpy_state(state: tuple) -> tuple:
    _, keys, position, has_gauss, gauss = state
    return keys.tobytes(), position, has_gauss, gauss


def _moved(before: tuple, after: tuple) -> bool:
    return not torch.equal(before[0], after[0]) or before[1:] != after[1:]


class WatchedDataset(Dataset):
    """`dataset`, whose fetches in a worker set `flag` when they move the worker's RNGs."""

    OWN = ("dataset", "flag", "unwatched")

    def __init__(self, dataset: Dataset, flag: DrawFlag):
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "flag", flag)
        object.__setattr__(self, "unwatched", WATCHED)  # counted down in each worker's own copy

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self._watched(lambda: self.dataset[index])

    def __getitems__(self, indices):
        # A DataLoader's fetcher asks for a batch through __getitems__ when the dataset has one, else item by item.
        getitems = getattr(self.dataset, "__getitems__", None)
        return self._watched(lambda: getitems(indices) if getitems else [self.dataset[index] for index in indices])

    # What a worker_init_fn reads or sets on get_worker_info().dataset (a file per worker) is the dataset's.
    def __getattr__(self, name: str):
        if name in self.OWN:  # not set yet: while unpickling in a worker
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def _watched(self, fetch):
        return _watched(self, fetch)


class WatchedCollate:
    """`collate_fn`, whose calls in a worker set `flag` when they move the worker's RNGs."""

    def __init__(self, collate_fn, flag: DrawFlag):
        self.collate_fn, self.flag, self.unwatched = collate_fn, flag, WATCHED

    def __call__(self, samples):
        return _watched(self, lambda: self.collate_fn(samples))


def _watched(watch, fetch):
    """`fetch()`; in a worker, for `watch`'s first fetches, whether it moved the worker's RNGs."""
    # In the loop's process (no worker info) GlobalRng restores the draws: nothing to watch there.
    if watch.unwatched == 0 or get_worker_info() is None or watch.flag.seen():
        return fetch()
    object.__setattr__(watch, "unwatched", watch.unwatched - 1)
    before = _rng_states()
    fetched = fetch()
    if _moved(before, _rng_states()):
        watch.flag.set()
    return fetched
