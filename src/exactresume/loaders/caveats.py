"""What makes a loader's order impossible to restore from the state a `ResumableLoader` keeps.

Said in one line, once, by the part (when it is saved or loaded), naming the loader and what to
change: a resume that cannot be exact is never a silent one.
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

# Samplers whose order is a function of their generator, the global RNG, their epoch and the dataset's
# length: torch's own and torchdata's (StatefulDataLoader's replacements of the same samplers).
KNOWN_SAMPLER_MODULES = ("torch.utils.data", "torchdata.stateful_dataloader")


def loader_name(loader) -> str:
    """'DataLoader over Squares': the loader's class and its dataset's, as a user's code names them."""
    return f"{type(loader).__name__} over {type(loader.dataset).__name__}"


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
