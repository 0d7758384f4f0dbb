"""A loader's index sampler that leaves out the index lists of batches the loop already took.

A `DataLoader` refuses a new `batch_sampler` once built, but its iterators read the index sampler
through `loader._index_sampler`, which is `batch_sampler` (or `sampler` without batching): a copy of
the loader holding this wrapper there skips batches before any of their data is read, in the main
process, before workers are sent anything, however many workers prefetch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class SkippingSampler:
    """`inner`'s index lists (or indices), less the first few of each epoch.

    A loader may open the sampler more than once per epoch (a worker iterator opens it as it is made and
    again as it primes its workers) and reads only the last one opened. `opened()` runs just before and
    just after each is opened (an eager `inner` draws its order then: torchdata's samplers do);
    `first_draw` runs when the loader asks for the first index of the one it reads, before a lazy
    `inner` draws (torch's RandomSampler), with the two values `opened()` returned and a way to open
    `inner` again, and returns the indices to read and how many of them to leave out; `skipped` runs
    once they are left out; `fetching(number)` runs as the loader asks for each index list it reads, the
    epoch's batch `number` counting from 1 (the left-out ones counted): without workers, just before its
    data is read; and once more, for the one after the last, as the epoch ends.
    """

    def __init__(
        self,
        inner: Iterable,
        opened: Callable[[], Any],
        first_draw: Callable[[tuple[Any, Any], Iterator, Callable[[], Iterator]], tuple[Iterator, int]],
        skipped: Callable[[], None],
        fetching: Callable[[int], None],
    ):
        self.inner, self.opened, self.first_draw, self.skipped = inner, opened, first_draw, skipped
        self.fetching = fetching

    def __len__(self) -> int:
        return len(self.inner)  # the whole epoch's, as the loader's own len() says

    def __iter__(self) -> Iterator:
        # iter() now, where the loader calls it: a sampler that draws its order eagerly (torchdata's) draws
        # here, and one that draws lazily (torch's RandomSampler) at the first next(), as without the wrapper.
        before = self.opened()
        indices = iter(self.inner)
        return self._rest((before, self.opened()), indices)

    def _rest(self, when_opened: tuple[Any, Any], indices: Iterator) -> Iterator:
        indices, skip = self.first_draw(when_opened, indices, lambda: iter(self.inner))
        if skip:
            next(itertools.islice(indices, skip, skip), None)  # consumes `skip` items, reads no data
        self.skipped()
        number = skip
        for number, item in enumerate(indices, start=skip + 1):
            self.fetching(number)
            yield item
        self.fetching(number + 1)  # the loader asks for one more, and learns the epoch is over
