"""What a `ResumableLoader` saves: where the loop is in the data, and what the loader must still be.

Every value is a tensor or a plain Python type, so `torch.load(weights_only=True)` reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from exactresume.errors import CheckpointError

from .sources import SourceStates, generators_of

# 2 added the shape's workers and the order's opening state, 3 the generators between epochs; older states
# read as before
VERSION = 3
READS = (1, 2, 3)


def loader_name(loader) -> str:
    """'DataLoader over Squares': the loader's class and its dataset's, as a user's code names them."""
    return f"{type(loader).__name__} over {type(loader.dataset).__name__}"


@dataclass(frozen=True)
class LoaderShape:
    """What decides which sample is at which position: a loader that differs here reads other data."""

    loader: str  # the loader's class: a DataLoader's order and a StatefulDataLoader's are drawn apart
    dataset_length: int | None  # None for a dataset without len() (an IterableDataset)
    batch_size: int | None  # None without batching (batch_size=None), or a custom batch sampler's own
    drop_last: bool
    sampler: str  # the sampler's class, and the batch sampler's: 'RandomSampler', 'BatchSampler'
    replicas: int | None  # a DistributedSampler's num_replicas: the world size it splits for
    generators: int  # how many torch.Generators the order draws from (sources.generators_of)
    workers: int | None = None  # num_workers (None: saved by a release that did not keep it)
    persistent: bool = False  # persistent_workers

    # A resume may change these where the order does not depend on them; where it does, the part says so
    # (caveats.worker_caveat), and nothing is refused here.
    MAY_CHANGE = ("workers", "persistent")

    @classmethod
    def of(cls, loader) -> LoaderShape:
        batch_sampler = loader.batch_sampler
        kinds = [type(loader.sampler).__name__] + ([type(batch_sampler).__name__] if batch_sampler is not None else [])
        return cls(
            loader=type(loader).__name__,
            dataset_length=_length_or_none(loader.dataset),
            batch_size=getattr(batch_sampler, "batch_size", None),
            drop_last=bool(getattr(batch_sampler, "drop_last", False)),
            sampler=" in ".join(kinds),
            replicas=getattr(loader.sampler, "num_replicas", None),
            generators=len(generators_of(loader)),
            workers=loader.num_workers,
            persistent=bool(loader.persistent_workers),
        )

    @property
    def keeps_iterator(self) -> bool:
        """Whether the loader keeps one iterator (and its workers) across epochs, drawing one base seed in all."""
        return self.persistent and bool(self.workers)

    def changes(self, saved: LoaderShape) -> list[str]:
        """Each field that differs, as 'its dataset_length is 24, 26 when saved'."""
        now = asdict(self)
        return [
            f"its {name} is {now[name]!r}, {value!r} when saved"
            for name, value in asdict(saved).items()
            if now[name] != value and name not in self.MAY_CHANGE
        ]


@dataclass
class LoaderPosition:
    """The epoch, the batches the loop took in it, and the random state its order was drawn from."""

    epoch: int = 0  # the epoch of the current iteration, or of the next when none has started
    consumed: int = 0  # batches handed to the loop in this epoch (never what workers prefetched)
    epoch_start: SourceStates | None = None  # just before the epoch's iter(): the workers' base seed
    order_start: SourceStates | None = None  # as the sampler the epoch reads was opened (an eager one draws)
    sampler_start: SourceStates | None = None  # at its first index (a lazy sampler draws the order then)
    sampler_epoch: int | None = None  # a DistributedSampler's set_epoch value during this epoch
    # Seen while iterating, kept across epochs: what makes another worker setup at a resume matter.
    drawn_when_opened: bool = False  # the sampler draws its order as it is opened (torchdata's do)
    worker_draws: bool = False  # the workers drew random numbers while they read samples
    # Between epochs: the generators as the last epoch left them, set back before the next one draws. The
    # global RNG is not kept here: the loop draws from it between epochs, and a GlobalRng part restores it.
    generators_after: tuple[torch.Tensor, ...] | None = None

    def next_epoch(self, generators: tuple[torch.Tensor, ...]) -> None:
        """The epoch is over, its draws left the loader's generators at `generators`: nothing else to restore."""
        self.epoch, self.consumed = self.epoch + 1, 0
        self.epoch_start = self.order_start = self.sampler_start = self.sampler_epoch = None
        self.generators_after = generators

    def to_state(self, shape: LoaderShape) -> dict:
        return {
            "version": VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "epoch_start": None if self.epoch_start is None else self.epoch_start.to_state(),
            "order_start": None if self.order_start is None else self.order_start.to_state(),
            "sampler_start": None if self.sampler_start is None else self.sampler_start.to_state(),
            "sampler_epoch": self.sampler_epoch,
            "drawn_when_opened": self.drawn_when_opened,
            "worker_draws": self.worker_draws,
            "generators_after": None if self.generators_after is None else list(self.generators_after),
            "shape": asdict(shape),
        }

    @classmethod
    def from_state(cls, state: object, loader) -> tuple[LoaderPosition, LoaderShape]:
        """The saved position and shape; a CheckpointError naming the loader for a state not ours."""
        keys = {"version", "epoch", "consumed", "epoch_start", "sampler_start", "sampler_epoch", "shape"}
        if isinstance(state, dict) and state.get("kind") == "hf_stream":
            raise CheckpointError(
                f"the saved state for the {loader_name(loader)} is a ResumableStream's, not a ResumableLoader's"
            )
        if not isinstance(state, dict) or not keys <= set(state):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"the saved state for the {loader_name(loader)} is not a ResumableLoader's: {found}")
        if state["version"] not in READS:
            readable = " and ".join(map(str, READS))
            raise CheckpointError(
                f"the {loader_name(loader)} was saved as version {state['version']}, this reads {readable}"
            )
        position = cls(
            epoch=int(state["epoch"]),
            consumed=int(state["consumed"]),
            epoch_start=SourceStates.from_state(state["epoch_start"]),
            order_start=SourceStates.from_state(state.get("order_start")),
            sampler_start=SourceStates.from_state(state["sampler_start"]),
            sampler_epoch=state["sampler_epoch"],
            drawn_when_opened=bool(state.get("drawn_when_opened", False)),
            worker_draws=bool(state.get("worker_draws", False)),
            generators_after=_tuple_or_none(state.get("generators_after")),
        )
        return position, LoaderShape(**state["shape"])


def _tuple_or_none(states: list | None) -> tuple[torch.Tensor, ...] | None:
    return None if states is None else tuple(states)


def _length_or_none(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset without __len__
        return None
