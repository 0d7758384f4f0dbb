"""What makes a loader's order impossible to restore from the state a `ResumableLoader` keeps.

Said in one line, once, by the part (when it is saved or loaded), naming the loader and what to
change: a resume that cannot be exact is never a silent one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset

from .position import loader_name

if TYPE_CHECKING:
    from .position import LoaderPosition, LoaderShape

# Samplers whose order is a function of their generator, the global RNG, their epoch and the dataset's
# length: torch's own and torchdata's (StatefulDataLoader's replacements of the same samplers), and
# Accelerate's, which shard or seed those (BatchSamplerShard, SeedableRandomSampler).
KNOWN_SAMPLER_MODULES = ("torch.utils.data", "torchdata.stateful_dataloader", "accelerate.data_loader")


def caveat(loader) -> str | None:
    """The one line that says why this loader's resume cannot be exact, or None when it can."""
    if isinstance(loader.dataset, IterableDataset):
        return (
            f"the {loader_name(loader)} reads an IterableDataset, which has no index to skip to: a resume reads "
            "again and drops the batches the loop took, exact only if the dataset yields the same items each "
            "time for the same worker seeds; a dataset with its own state_dict() is better saved as its own part"
        )
    for sampler in (loader.sampler, loader.batch_sampler):
        if not known(sampler):
            return (
                f"the {loader_name(loader)} draws its order from {type(sampler).__name__}, which has no generator: "
                "the resume is exact only if that order depends on nothing but torch's global RNG (not on python's "
                "random, numpy or a cursor of its own); give it a torch.Generator as its `generator` attribute"
            )
    return None


def known(sampler) -> bool:
    """Whether a sampler's order comes only from what the part restores: torch's and torchdata's samplers,
    and any other that draws from a torch.Generator of its own (`generator`, as RandomSampler)."""
    if sampler is None or type(sampler).__module__.startswith(KNOWN_SAMPLER_MODULES):
        return True
    return isinstance(getattr(sampler, "generator", None), torch.Generator)


def worker_draws_caveat(loader) -> str:
    """The line for a dataset (`__getitem__`) or collate function that draws random numbers in the loader's workers."""
    return (
        f"the {loader_name(loader)} draws random numbers in its workers while reading or collating samples (a "
        "worker's torch, python or numpy RNG moved during a fetch): those RNGs live in the workers and are not "
        "saved, so a run resumed mid-epoch draws others; draw them from a torch.Generator seeded by the sample's "
        "index and the epoch (docs/loaders.md, random augmentation), or with num_workers=0"
    )


def worker_caveat(loader, saved: LoaderShape, now: LoaderShape, seen: LoaderPosition) -> str | None:
    """The line for a resume with other workers than the save, where the order or the draws depend on them."""
    if saved.workers is None or (saved.workers, saved.persistent) == (now.workers, now.persistent):
        return None
    if isinstance(loader.dataset, IterableDataset) and saved.workers != now.workers:
        why = "an IterableDataset's items are read by each worker in turn, so their order depends on the count"
    elif seen.worker_draws and saved.workers != now.workers:
        why = "its workers draw random numbers while reading samples, and each worker now reads other samples"
    elif seen.drawn_when_opened and _opens(saved) != _opens(now):
        why = (
            f"its {type(loader.sampler).__name__} draws a new order each time the loader opens it, and how often "
            "a loader opens it depends on its workers: the epochs after this one will differ from the saved run's"
        )
    elif saved.keeps_iterator != now.keeps_iterator and (seed_source := _seed_source(loader)) is not None:
        why = (
            f"it draws its workers' base seed from {seed_source} once per process with persistent "
            "workers and once per epoch without: the epochs after this one will differ from the saved run's"
        )
    else:
        return None
    changed = f"was saved with {_setup(saved)} and now has {_setup(now)}"
    return f"the {loader_name(loader)} {changed}: {why}; resume with {_setup(saved)} to be exact"


def _opens(shape: LoaderShape) -> tuple[bool, bool]:
    """What decides how often a loader opens its sampler: in its own process, or through (persistent) workers."""
    return shape.workers > 0, shape.keeps_iterator


def _seed_source(loader) -> str | None:
    """Where each new iterator draws its workers' base seed, when what it draws from reads on: the global
    RNG (dropout, a sampler without a generator), or a generator the order is drawn from too; else None."""
    if loader.generator is None:
        return "the global RNG"
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(getattr(sampler, "generator", None) is loader.generator for sampler in samplers):
        return "the generator its order is drawn from"
    return None


def _setup(shape: LoaderShape) -> str:
    return f"num_workers={shape.workers}" + (", persistent_workers=True" if shape.persistent else "")
