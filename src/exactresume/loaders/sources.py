"""The random state a loader's order is drawn from: torch's global RNG and the loader's generators.

A `DataLoader` iterator draws its workers' base seed from `loader.generator`, or from the global RNG
when there is none, and a `RandomSampler` draws its order (or its seed) from its own `generator`, else
the global RNG. Whatever else a sampler draws from (python's `random`, numpy) is not restored here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SourceStates:
    """The states of a loader's random sources at one moment; tensors, so a file keeps them as they are."""

    global_rng: torch.Tensor  # torch.get_rng_state(): the CPU generator the samplers fall back on
    generators: tuple[torch.Tensor, ...]  # each generator's get_state(), in `generators_of` order

    def to_state(self) -> dict:
        return {"global": self.global_rng, "generators": list(self.generators)}

    def same_as(self, other: SourceStates) -> bool:
        """Whether every source is where it was in `other`: nothing drew from them between the two."""
        pairs = [(self.global_rng, other.global_rng), *zip(self.generators, other.generators)]
        return len(self.generators) == len(other.generators) and all(torch.equal(a, b) for a, b in pairs)

    @classmethod
    def from_state(cls, state: dict | None) -> SourceStates | None:
        if state is None:
            return None
        return cls(state["global"], tuple(state["generators"]))


def generators_of(loader) -> list[torch.Generator]:
    """Each torch.Generator the loader's order may draw from, once: the loader's own, its sampler's, its
    batch sampler's sampler's (a custom batch sampler around a RandomSampler), and so on down the samplers
    a batch sampler wraps (Accelerate's BatchSamplerShard around a BatchSampler around a RandomSampler)."""
    found: list[torch.Generator] = []
    for holder in _samplers_under(loader):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and not any(generator is seen for seen in found):
            found.append(generator)
    return found


def _samplers_under(holder, depth: int = 4) -> list:
    """`holder`, then what its `sampler` and `batch_sampler` hold, depth first, `depth` levels down."""
    if holder is None or depth == 0:
        return []
    below = [_samplers_under(getattr(holder, name, None), depth - 1) for name in ("sampler", "batch_sampler")]
    return [holder, *below[0], *below[1]]


class RandomSources:
    """Read and set the global RNG and a loader's generators together."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    def states(self) -> SourceStates:
        return SourceStates(torch.get_rng_state(), tuple(generator.get_state() for generator in self.generators))

    def set(self, states: SourceStates) -> None:
        torch.set_rng_state(states.global_rng)
        self.set_generators(states.generators)

    def set_generators(self, states: tuple[torch.Tensor, ...]) -> None:
        for generator, state in zip(self.generators, states):
            generator.set_state(state)

    def set_global(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)
