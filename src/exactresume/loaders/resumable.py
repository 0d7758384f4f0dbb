"""A user's own `DataLoader` (or torchdata `StatefulDataLoader`) as a part whose resume is exact.

    loader = ResumableLoader(DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2))
    parts = {"model": model, "optimizer": optimizer, "rng": GlobalRng(), "loader": loader}
    step = store.load(parts) or 0
    while loader.epoch < epochs:
        for batch in loader:
            ...
            step += 1
            store.save(step, parts)

The state is the epoch, the batches the loop took in it (counted as they are handed to the loop,
never what workers prefetched), and the states of the random sources the epoch's order and its
workers' base seed were drawn from, read just before they were drawn. A load changes nothing at
once: the next iteration sets those sources back, lets the sampler draw the same order, leaves out
the index lists of the batches already taken (reading none of their data), and puts the global RNG
back as the other parts left it, so a `GlobalRng` part loaded after this one is not disturbed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset

from exactresume.errors import CheckpointError, FieldError, a_kind_of, notice

from .caveats import caveat, worker_caveat, worker_draws_caveat
from .position import LoaderPosition, LoaderShape, loader_name
from .skipping import SkippingSampler
from .sources import RandomSources, SourceStates, generators_of
from .worker_draws import DrawFlag, WatchedCollate, WatchedDataset


@dataclass(frozen=True)
class EpochPlan:
    """How the epoch being started differs from a fresh one: nothing, unless it resumes a loaded one."""

    skip: int = 0  # index lists the sampler leaves out (batches the loop took before the save)
    order_start: SourceStates | None = None  # the sources as the sampler read was opened, when resuming
    sampler_start: SourceStates | None = None  # set just before the sampler draws, when resuming
    put_back: torch.Tensor | None = None  # the global RNG as the loaded parts left it, set once skipped


class ResumableLoader:
    """Iterate it as the loader it wraps; save and load it as a part (`per_rank`: each rank's own)."""

    per_rank = True  # each rank of a DistributedSampler run has its own position and global RNG

    def __init__(self, loader: DataLoader):
        if isinstance(loader, ResumableLoader):
            raise FieldError(
                "ResumableLoader takes a torch DataLoader, got one already wrapped: wrap it once", "loader"
            )
        if not isinstance(loader, DataLoader):
            raise FieldError(f"ResumableLoader takes a torch DataLoader, got {a_kind_of(loader)}", "loader")
        self.loader = loader  # the user's, left as it is
        self.iterable = isinstance(loader.dataset, IterableDataset)
        self.sources = RandomSources(generators_of(loader))
        self.position = LoaderPosition()
        self.plan = EpochPlan()
        self.resuming = False  # a loaded position waits for the next iteration
        self.loaded_between = False  # a position loaded between epochs, whose next epoch has not begun
        self.cautioned = False
        self.draws = DrawFlag()  # set by the workers when a fetch moves their RNGs (worker_draws.py)
        # A framework that fetches ahead of its loop watches each fetch (exactresume.integrations).
        self.fetch_hook: Callable[[int], None] | None = None
        self.finished: LoaderPosition | None = None  # the last epoch, as it ended, until the next begins
        self._iterated = _with_index_sampler(loader, self._opened, self._first_draw, self._skipped, self._fetching)
        if loader.num_workers > 0 and not self.iterable:
            object.__setattr__(self._iterated, "dataset", WatchedDataset(loader.dataset, self.draws))
            object.__setattr__(self._iterated, "collate_fn", WatchedCollate(loader.collate_fn, self.draws))

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the next one: `while loader.epoch < epochs: for batch in loader:`."""
        return self.position.epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        position, resuming = self.position, self.resuming
        self.resuming = False
        if resuming:  # even an epoch saved after its last batch: its generators end where its draws left them
            self.plan = EpochPlan(
                position.consumed, position.order_start, position.sampler_start, torch.get_rng_state()
            )
            set_sampler_epoch(self.loader, position.sampler_epoch)
            self.sources.set(position.epoch_start)  # the workers' base seed is drawn from it at iter()
        else:
            self.finished = None
            if position.generators_after is not None:  # saved between epochs: the last one's draws, set back
                self.sources.set_generators(position.generators_after)
            self.plan = EpochPlan(order_start=self._kept_iterator_start())
            position.consumed, position.order_start, position.sampler_start = 0, None, None
            position.generators_after = None
            position.epoch_start, position.sampler_epoch = self.sources.states(), _sampler_epoch(self.loader)
        batches = iter(self._iterated)
        if self.iterable and resuming:
            self._replay(batches, position.consumed)
        for batch in batches:
            position.consumed += 1  # before the loop gets it: a save inside the loop body counts it
            yield batch
        self.finished = dataclasses.replace(position)
        position.next_epoch(self.sources.states().generators)

    def _kept_iterator_start(self) -> SourceStates | None:
        """Loaded between epochs from a run whose loader kept its iterator (persistent workers): that run
        opened this epoch's sampler from the sources as they are now, drawing no new workers' base seed,
        where this process's first iterator draws one first. The sampler is opened from them again."""
        loaded, self.loaded_between = self.loaded_between, False
        if loaded and LoaderShape.of(self.loader).keeps_iterator and self._iterated._iterator is None:
            return self.sources.states()
        return None

    def _opened(self) -> SourceStates:
        return self.sources.states()

    def _first_draw(self, opened: tuple[SourceStates, SourceStates], indices: Iterator, reopen: Callable[[], Iterator]):
        """At the first index of the sampler the epoch reads, given its sources just before and after it was
        opened: the indices to read, and how many of them to skip.

        A resumed loader may open its sampler from other states than the saved run did (a persistent
        worker iterator opens it once an epoch, a new one twice, drawing a seed in between; so does
        another worker count): a sampler opened from other states is opened again from the saved ones.
        """
        plan, (before, after) = self.plan, opened
        if plan.order_start is not None and not before.same_as(plan.order_start):
            self.sources.set(plan.order_start)
            before, indices = plan.order_start, reopen()
            after = self.sources.states()
        self.position.drawn_when_opened |= not before.same_as(after)
        if plan.sampler_start is not None:
            self.sources.set(plan.sampler_start)
        self.position.order_start, self.position.sampler_start = before, self.sources.states()
        return indices, 0 if self.iterable else plan.skip

    def _fetching(self, number: int) -> None:
        if self.fetch_hook is not None:
            self.fetch_hook(number)

    def _skipped(self) -> None:
        if self.plan.put_back is not None and not self.iterable:
            self.sources.set_global(self.plan.put_back)

    def _replay(self, batches: Iterator, count: int) -> None:
        """An IterableDataset has no index to skip to: read the batches the loop took, and drop them."""
        for _ in range(count):
            next(batches, None)
        self.sources.set_global(self.plan.put_back)

    def state_dict(self) -> dict:
        self._said_at_save()
        return self.position.to_state(LoaderShape.of(self.loader))

    def _said_at_save(self) -> None:
        """Once, at a save: an order that cannot be restored exactly, random numbers drawn in the workers."""
        self._caution()
        if self.draws.seen() and not self.position.worker_draws:
            self.position.worker_draws = True
            if self.finished is not None:  # what a save between epochs holds
                self.finished.worker_draws = True
            notice(worker_draws_caveat(self.loader))

    @property
    def between_epochs(self) -> bool:
        """Whether the epoch ended under the loop (its iterator ran out) and the next has not begun."""
        return self.finished is not None and self.position.epoch_start is None

    def state_taken(self, taken: int) -> dict:
        """The state as a loop that took `taken` batches of its epoch sees it, where a framework fetches
        ahead of its loop (the epoch it reads may have ended under it, the next not begun) or stops
        asking at the epoch's length: once the loop took the whole epoch, the state is the next epoch's,
        as a save between epochs gives."""
        self._said_at_save()
        ended = self.between_epochs
        position = self.finished if ended else self.position
        if not 0 <= taken <= position.consumed:
            raise CheckpointError(
                f"the loop took {taken} batches of an epoch the {loader_name(self.loader)} handed out "
                f"{position.consumed} of"
            )
        if ended and taken == position.consumed:
            return self.state_dict()
        position = dataclasses.replace(position, consumed=taken)
        if taken == _batches(self.loader):
            position.next_epoch(self.sources.states().generators)
        return position.to_state(LoaderShape.of(self.loader))

    def load_state_dict(self, state: dict) -> None:
        """Check the loader against the saved one (CheckpointError, nothing changed); restored at next iter()."""
        position, saved = LoaderPosition.from_state(state, self.loader)
        now = LoaderShape.of(self.loader)
        changes = now.changes(saved)
        if changes:
            raise CheckpointError(f"the {loader_name(self.loader)} is not the one saved: {'; '.join(changes)}")
        self.position, self.resuming = position, position.epoch_start is not None
        self.loaded_between = not self.resuming
        self._caution()
        changed_workers = worker_caveat(self.loader, saved, now, position)
        if changed_workers is not None:
            notice(changed_workers)
        position.worker_draws = False  # said again at this run's first save if its workers draw too

    def _caution(self) -> None:
        """Say once, in one line, when this loader's order cannot be restored exactly."""
        if not self.cautioned:
            self.cautioned = True
            message = caveat(self.loader)
            if message is not None:
                notice(message)


def _with_index_sampler(loader: DataLoader, opened, first_draw, skipped, fetching) -> DataLoader:
    """A shallow copy of `loader` whose index sampler is a SkippingSampler around its own."""
    iterated = copy.copy(loader)
    iterated._iterator = None  # persistent workers of the user's loader stay the user's
    # DataLoader.__setattr__ refuses `batch_sampler` and `sampler` after __init__: set past it, on the copy.
    attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    sampler = SkippingSampler(getattr(loader, attribute), opened, first_draw, skipped, fetching)
    object.__setattr__(iterated, attribute, sampler)
    return iterated


def _batches(loader: DataLoader) -> int | None:
    """The batches an epoch of `loader` holds, or None where it cannot say (an IterableDataset's)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _epoch_holder(loader: DataLoader):
    """The sampler with `set_epoch` (a DistributedSampler), directly or inside a batch sampler, or None."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            return sampler
    return None


def _sampler_epoch(loader: DataLoader) -> int | None:
    holder = _epoch_holder(loader)
    return None if holder is None else int(getattr(holder, "epoch", 0))


def set_sampler_epoch(loader: DataLoader, epoch: int | None) -> None:
    holder = _epoch_holder(loader)
    if holder is not None and epoch is not None:
        holder.set_epoch(epoch)
