"""The resume file: every part a run needs to continue exactly, captured, saved, verified, restored.

The file is `torch.save` of the state, a plain dict of tensors and Python values, one key per part,
each its object's `state_dict()`: `{"format", "version", "config", "model", "optimizer", "step",
"gen_state", "rng"}`, and `scaler` (the GradScaler) in fp16 runs only. So
`torch.load(path, weights_only=True)`, with nothing of ours imported, gives the lab's dict:
`["model"]` name -> tensor, `["optimizer"]` with `state` and `param_groups`, `["step"]` an int,
`["gen_state"]` the batch generator's state. Weights are stored in fp32 as trained, never
rounded. `gen_state` is the data position of whichever loader the run uses. A file holds no
gradients: it is written only between optimizer steps, never inside gradient accumulation.
`restore(..., skip=...)` leaves parts out on purpose: the lab's `--no-optim` and `--no-skip` are
this same code with one part skipped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from exactresume.errors import CheckpointError
from exactresume.store.formats import RESUME_FORMAT, RESUME_VERSION, RESUME_VERSIONS, check_format
from exactresume.store.sealed import load_sealed, save_sealed
from exactresume.world import World

# config first: a resume file from a different run is refused before anything is overwritten.
PART_NAMES = ("config", "model", "optimizer", "scaler", "step", "gen_state", "rng")
OPTIONAL_PARTS = ("scaler",)  # held only by runs that have one; the config says which
# Parts whose state may differ between ranks, so each rank's is kept.
PER_RANK_PARTS = ("gen_state", "rng")
# Every rank draws the same global batch, so the batch generator's state is saved once, as one
# process saves it (the lab's `gen_state`), unless the ranks disagree.
ONCE_WHEN_EQUAL = ("gen_state",)
PER_RANK_KEY = "per_rank"


class Stateful(Protocol):
    """What a part is: PyTorch's own state_dict / load_state_dict protocol."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


def capture(parts: Mapping[str, Stateful]) -> dict:
    """The resume state of `parts` as one dict: tensors and plain Python values only."""
    return {"format": RESUME_FORMAT, "version": RESUME_VERSION} | {
        name: part.state_dict() for name, part in parts.items()
    }


def restore(state: Mapping, parts: Mapping[str, Stateful], skip: Collection[str] = ()) -> None:
    """Load every part of `state` into `parts`, except those named in `skip`."""
    unknown = set(skip) - set(PART_NAMES)
    if unknown:
        raise ValueError(f"cannot skip unknown parts {sorted(unknown)}")
    ordered = [name for name in PART_NAMES if name in parts] + [name for name in parts if name not in PART_NAMES]
    for name in ordered:
        if name not in skip:
            if name not in state:
                raise CheckpointError(f"the resume file lacks the part {name} this run needs")
            parts[name].load_state_dict(state[name])


def save_resume(path: Path, parts: Mapping[str, Stateful]) -> None:
    """Write the resume file atomically, with its checksum."""
    save_sealed(path, capture(parts))


def check_resume_state(path: Path, state: object) -> dict:
    """Raise CheckpointError unless `state` is a complete resume file of a version we read."""
    check_format(path, state, RESUME_FORMAT, RESUME_VERSIONS, "a resume file")
    missing = [name for name in PART_NAMES if name not in state and name not in OPTIONAL_PARTS]
    if missing:
        raise CheckpointError(f"{path} lacks the parts {', '.join(missing)}")
    return state


def load_resume(path: Path) -> dict:
    """Verify the checksum, load with weights_only=True, and check it is a complete resume file."""
    return check_resume_state(path, load_sealed(Path(path)))


class PerRank:
    """A part saved as the list of every rank's state, and restored from this rank's entry.

    One process saves its plain state, so single-process resume files keep their layout, and so does
    a part saved `once_when_equal` whose state every rank shares. On resume
    with a different N, rank r takes saved rank r's state, or rank 0's when the run had fewer ranks:
    the batch generator is the same on every rank, so the samples stay exact; the RNG streams of
    ranks that did not exist start as rank 0's (they only matter for random draws such as dropout).
    """

    def __init__(self, part: Stateful, world: World, once_when_equal: bool = False):
        self.part, self.world, self.once_when_equal = part, world, once_when_equal

    def state_dict(self) -> Any:
        states = self.world.gather(self.part.state_dict())
        if len(states) == 1 or self.once_when_equal and all(same_state(states[0], other) for other in states[1:]):
            return states[0]
        return {PER_RANK_KEY: states}

    def load_state_dict(self, state: Any) -> None:
        states = saved_states(state)
        self.part.load_state_dict(states[self.world.rank] if self.world.rank < len(states) else states[0])


def same_state(a: Any, b: Any) -> bool:
    """Two nested states hold the same values: tensors `torch.equal` (same dtype and shape), the rest `==`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return type(a) is type(b) and a == b


def saved_states(state: Any) -> list:
    """The per-rank states a part was saved with (one entry for a single-process file)."""
    return state[PER_RANK_KEY] if isinstance(state, dict) and PER_RANK_KEY in state else [state]


def saved_world_size(state: Mapping) -> int:
    """How many processes wrote a resume state."""
    return len(saved_states(state["rng"]))


def per_rank(parts: Mapping[str, Stateful], world: World) -> dict[str, Stateful]:
    """`parts` with the per-rank ones wrapped so a resume file keeps every rank's state."""
    return {
        name: PerRank(part, world, once_when_equal=name in ONCE_WHEN_EQUAL) if name in PER_RANK_PARTS else part
        for name, part in parts.items()
    }
