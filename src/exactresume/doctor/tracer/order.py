"""Where a DataLoader's order really comes from: its batch_sampler and the wrappers around it followed
down to the sampler and the generator that draw it.

A DataLoader given a batch_sampler keeps a SequentialSampler as `.sampler` that nothing draws from;
Accelerate's DataLoaderShard builds its DataLoader that way over a BatchSamplerShard or a
SkipBatchSampler around the user's BatchSampler and its RandomSampler. Every sampler, batch sampler
and wrapper met on the way down (`.batch_sampler`, then `.sampler`) is named; the last is the one
that draws.
"""

from __future__ import annotations

import weakref

import torch

from . import streams
from .fingerprint import digest

SEEDED = ("seed", "initial_seed")  # samplers whose order is a function of a seed and set_epoch's epoch


CHAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> its chain, followed once


def chain(loader) -> list:
    """The loader's batch sampler, the samplers it wraps, down to the one that draws the order (a
    DataLoader's batch_sampler and sampler cannot be set after it is made: followed once per loader)."""
    try:
        return CHAINS[loader]
    except KeyError:
        CHAINS[loader] = found = follow(loader)
        return found
    except TypeError:  # an object without weak references or a hash
        return follow(loader)


def follow(loader) -> list:
    found: list = []
    node = inner(loader)
    while node is not None and len(found) < 8 and all(node is not seen for seen in found):
        found.append(node)
        node = inner(node)
    return found


def inner(node):
    """The batch sampler or sampler `node` draws from. `is None`, never truth: a sampler's truth is its
    len(), which an IterableDataset's (_InfiniteConstantSampler) does not have."""
    found = getattr(node, "batch_sampler", None)
    return getattr(node, "sampler", None) if found is None else found


def drawer(loader):
    """The sampler that draws the order (an IterableDataset's draws nothing: it yields its own order)."""
    found = chain(loader)
    return found[-1] if found else None


def generators(loader) -> list[tuple[str, torch.Generator]]:
    """The torch.Generators the order and the workers' base seed come from, each once, with where it is;
    not a seeded sampler's (it seeds its generator from its seed and epoch as each epoch begins)."""
    sampler = drawer(loader)
    rows: list[tuple[str, torch.Generator]] = []
    own = None if seeded(sampler) else getattr(sampler, "generator", None)
    for where, gen in (
        (f"{type(sampler).__name__}'s generator", own),
        ("DataLoader's generator", getattr(loader, "generator", None)),
    ):
        if isinstance(gen, torch.Generator) and all(gen is not g for _, g in rows):
            rows.append((where, gen))
    return rows


def seeded(sampler) -> bool:
    return hasattr(sampler, "set_epoch") and any(hasattr(sampler, name) for name in SEEDED)


def state(loader) -> list:
    """The drawing sampler's kind, its epoch (set_epoch), and its generators' states: the data fingerprint."""
    sampler = drawer(loader)
    return [
        type(sampler).__name__,
        getattr(sampler, "epoch", None),
        [digest(g.get_state()) for _, g in generators(loader)],
    ]


def _draws_from(loader) -> str:
    """What the drawing sampler's order is a function of, in words."""
    sampler = drawer(loader)
    if iterable(loader):
        return streams.words(loader.dataset)
    if stateful(loader) and not unkept(sampler):
        return f"a {type(loader).__name__} over a {type(sampler).__name__} (its position is in its state_dict())"
    words = _sampler_words(sampler)
    if stateful(loader):  # its state_dict() counts the batches yielded; this sampler's draws are not in it
        return f"{words}; its order is not in {type(loader).__name__}'s state_dict(), only the batches yielded"
    return words


def _sampler_words(sampler) -> str:
    kind = type(sampler).__name__
    if seeded(sampler):
        return f"a {kind} (order from its seed and set_epoch's epoch)"
    if isinstance(getattr(sampler, "generator", None), torch.Generator):
        return f"a {kind} (order from the torch.Generator passed as generator=)"
    if isinstance(sampler, torch.utils.data.RandomSampler | torch.utils.data.SubsetRandomSampler):
        return f"a {kind} drawing its seed from the global torch RNG each time an iterator is made"
    return f"a {kind}"


def unkept(sampler) -> bool:
    """A random sampler whose draws a StatefulDataLoader's state_dict() does not hold: neither torchdata's
    own (their iterators save the generator) nor one with a state_dict() of its own."""
    if type(sampler).__module__.startswith("torchdata.") or hasattr(sampler, "state_dict"):
        return False
    random = torch.utils.data.RandomSampler | torch.utils.data.SubsetRandomSampler
    return isinstance(sampler, random) or isinstance(getattr(sampler, "generator", None), torch.Generator)


def describe(loader, wrapper: str | None) -> str:
    """The whole way down, e.g. "Accelerate's DataLoaderShard > DataLoader > BatchSampler > a RandomSampler ..."."""
    names = [] if iterable(loader) else [type(node).__name__ for node in chain(loader)[:-1]]
    outer = [wrapper] if wrapper else []
    own = type(loader).__name__ if stateful(loader) else "DataLoader"
    return " > ".join([*outer, own, *names, _draws_from(loader)])


def stateful(loader) -> bool:
    """torchdata's StatefulDataLoader: a DataLoader whose state_dict() holds its position."""
    return type(loader).__module__.startswith("torchdata.") and hasattr(loader, "state_dict")


def iterable(loader) -> bool:
    return isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)


def wrapper_of(loader, caller) -> str | None:
    """The object whose __init__ built this DataLoader as its inner loader (Accelerate's adapters), in words;
    `caller`: the frame that called the DataLoader's __init__."""
    outer = caller.f_locals.get("self")
    # type(), not isinstance(): an Accelerate adapter's __class__ pretends to be its inner DataLoader's
    if outer is None or outer is loader or issubclass(type(outer), torch.utils.data.DataLoader):
        return None
    package = type(outer).__module__.split(".")[0]
    return f"{package.capitalize()}'s {type(outer).__name__}"
