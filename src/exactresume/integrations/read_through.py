"""The loader a framework reads in place of the user's: the same loader, iterated through a ResumableLoader.

Frameworks keep the loader they were given and read its attributes (its sampler, to set a
DistributedSampler's epoch; its dataset and batch size), so every attribute is the user's loader's,
and it passes for a DataLoader as Accelerate's own wrapper does. Its state is not the framework's to
save: it has no `state_dict`, so Lightning and Accelerate do not keep a second, stale copy of it.
"""

from __future__ import annotations

from collections.abc import Iterator

from .loop_state import LoopState

NOT_FORWARDED = ("state_dict", "load_state_dict")


class ReadThrough:
    def __init__(self, state: LoopState):
        object.__setattr__(self, "loop_state", state)

    def __iter__(self) -> Iterator:
        self.loop_state.iterations += 1
        self.loop_state.begin()
        for batch in self.loop_state.loader:
            self.loop_state.fetches.fetched()
            yield batch

    def __len__(self) -> int:
        return len(self.loop_state.loader)

    def __getattr__(self, name: str):
        if name in NOT_FORWARDED:
            raise AttributeError(name)
        return getattr(self.loop_state.loader.loader, name)

    @property
    def __class__(self):  # isinstance(x, DataLoader) holds, as for the loader it stands for
        return type(self.loop_state.loader.loader)
