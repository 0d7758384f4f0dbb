"""A loader's index sampler that leaves out the index lists of batches the loop already took.

A `DataLoader` refuses a new `batch_sampler` once built, but its iterators read the index sampler
through `loader._index_sampler`, which is `batch_sampler` (or `sampler` without batching): a copy of
the loader holding this wrapper there skips batches before any of their data is read, in the main
process, before workers are sent anything, however many workers prefetch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator


class SkippingSampler:
    """`inner`'s index lists (or indices), less the first `first_draw()` of each epoch.

    `first_draw` runs when the loader asks for its first index of an epoch, just before a lazy `inner`
    draws its order (a RandomSampler draws its seed there), and returns how many to leave out;
    `skipped` runs once they are left out, before the first index is handed to the loader.
    """

    def __init__(self, inner: Iterable, first_draw: Callable[[], int], skipped: Callable[[], None]):
        self.inner, self.first_draw, self.skipped = inner, first_draw, skipped

    def __len__(self) -> int:
        return len(self.inner)  # the whole epoch's, as the loader's own len() says

    def __iter__(self) -> Iterator:
        # iter() now, where the loader calls it: a sampler that draws its order eagerly (torchdata's) draws
        # here, and one that draws lazily (torch's RandomSampler) at the first next(), as without the wrapper.
        return self._rest(iter(self.inner))

    def _rest(self, indices: Iterator) -> Iterator:
        skip = self.first_draw()
        if skip:
            next(itertools.islice(indices, skip, skip), None)  # consumes `skip` items, reads no data
        self.skipped()
        yield from indices
