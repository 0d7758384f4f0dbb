"""What a framework's checkpoint lacks for an exact resume: where its loop is in the loader, and the
global RNG as the uninterrupted run drew from it next, along the fetches the framework made ahead.

Frameworks read their loader ahead of the loop (Lightning's fetcher and Accelerate's DataLoaderShard
hold the next batch before the loop takes the current one), so when a checkpoint is saved the loader
has handed out more batches than the loop took, and without workers each of those fetches ran in this
process, where a data collator or a dataset may draw random numbers (masking, cropping). The
uninterrupted run drew them from the global RNG as it was before each fetch, and the steps after the
save from the RNG as it was at the save. So a resume sets the loader back to the batches the loop took,
sets the RNG before each of those fetches again as the uninterrupted run had it, and once they are
read, sets it as it was at the save. Saved between epochs, the RNG is set at once, before the next
epoch's iterator draws its order and its workers' seed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from exactresume.errors import CheckpointError
from exactresume.loaders.resumable import ResumableLoader
from exactresume.parts import GlobalRng

VERSION = 1
KEPT = 64  # fetches whose RNG is kept: more than any framework fetches ahead of its loop
WATCHED = 16  # fetches a process checks for draws before it stops keeping their RNG


class FetchRng:
    """The global RNG as each fetch of the current epoch found it; and, at a resume, set back at each.

    Reading the RNG costs about 50 us, so a process watches its first WATCHED fetches: where none of
    them moved the RNG, fetches do not draw (a random choice of whether to augment is a draw too), and
    no more are kept; the RNG at the save is then right for every fetch after it.
    """

    def __init__(self, in_this_process: bool):
        self.keeping = in_this_process  # without workers: only then does a fetch draw here
        self.watched = 0
        self.before: OrderedDict[int, dict] = OrderedDict()
        self.planned: dict[int, dict] = {}

    def fetching(self, number: int) -> None:
        """The loader is about to read the epoch's batch `number` (from 1)."""
        if number == 1 and not self.planned:
            self.before.clear()
        planned = self.planned.pop(number, None)
        if planned is not None:
            GlobalRng().load_state_dict(planned)
        if self.keeping:
            self.before[number] = GlobalRng().state_dict()
            while len(self.before) > KEPT:
                self.before.popitem(last=False)

    def fetched(self) -> None:
        """The batch last asked for is read: while watching, whether reading it drew."""
        if not self.keeping or self.watched >= WATCHED or not self.before:
            return
        self.watched += 1
        if not _same_rng(next(reversed(self.before.values())), GlobalRng().state_dict()):
            self.watched = WATCHED  # they draw: every fetch's RNG is kept from now on
        elif self.watched == WATCHED:
            self.keeping = False
            self.before.clear()

    def ahead_of(self, taken: int) -> list[dict]:
        """The RNG before each fetch after the loop's `taken` batches, as far as they were made."""
        ahead, number = [], taken + 1
        while number in self.before:
            ahead.append(self.before[number])
            number += 1
        return ahead

    def plan(self, taken: int, ahead: list[dict], at_save: dict) -> None:
        """At the resumed epoch's fetches after `taken`: each fetch's saved RNG, then the save's."""
        self.planned = {taken + 1 + index: state for index, state in enumerate(ahead)}
        self.planned[taken + 1 + len(ahead)] = at_save


class LoopState:
    """A ResumableLoader around the loader a framework reads, with the RNG of the fetches it made ahead."""

    def __init__(self, loader: ResumableLoader):
        self.loader = loader
        self.fetches = FetchRng(in_this_process=loader.loader.num_workers == 0)
        loader.fetch_hook = self.fetches.fetching
        self.rng_now: dict | None = None  # loaded between epochs: set just before the next epoch begins
        self.off = False  # the framework reads the loader without it now: nothing of it is saved
        self.iterations = 0  # iterations the framework began: a new one begins an epoch's count of batches

    def state_dict(self, taken: int) -> dict:
        """Everything a resume needs, where the loop took `taken` batches of its epoch."""
        loader_state = self.loader.state_taken(taken)
        between_epochs = loader_state["epoch_start"] is None
        return {
            "version": VERSION,
            "loader": loader_state,
            "rng": GlobalRng().state_dict(),
            "ahead": [] if between_epochs else self.fetches.ahead_of(taken),
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"the loop state is version {found!r}, this reads {VERSION}")
        self.loader.load_state_dict(state["loader"])
        if state["loader"]["epoch_start"] is None:
            self.rng_now = state["rng"]
        else:
            self.fetches.plan(int(state["loader"]["consumed"]), list(state["ahead"]), state["rng"])

    def begin(self) -> None:
        """Just before the framework opens the resumed loader: the RNG of a save between epochs."""
        if self.rng_now is not None:
            GlobalRng().load_state_dict(self.rng_now)
            self.rng_now = None


def _same_rng(a: dict, b: dict) -> bool:
    """Whether two GlobalRng states are the same state (torch's, numpy's and python's generators)."""
    numpy_a, numpy_b = a.get("numpy"), b.get("numpy")
    numpy_same = numpy_a is None or (
        torch.equal(numpy_a["keys"], numpy_b["keys"])
        and (numpy_a["pos"], numpy_a["has_gauss"], numpy_a["cached_gaussian"])
        == (numpy_b["pos"], numpy_b["has_gauss"], numpy_b["cached_gaussian"])
    )
    return torch.equal(a["torch"], b["torch"]) and numpy_same and a["python"] == b["python"]
