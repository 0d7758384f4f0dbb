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
from typing import TYPE_CHECKING, Any

from exactresume.errors import CheckpointError
from exactresume.store.formats import RESUME_FORMAT, RESUME_VERSION, RESUME_VERSIONS, check_format
from exactresume.store.sealed import load_sealed, save_sealed
from exactresume.world import World

if TYPE_CHECKING:  # PyTorch's own part protocol, DCP's: importing DCP costs a second, so only for types
    from torch.distributed.checkpoint.stateful import Stateful

# config first: a resume file from a different run is refused before anything is overwritten.
PART_NAMES = ("config", "model", "optimizer", "scaler", "step", "gen_state", "rng")
OPTIONAL_PARTS = ("scaler",)  # held only by runs that have one; the config says which
STEP_KEY = "checkpoint_step"  # beside the parts in every file: the step it was saved at
RESERVED_NAMES = ("format", "version", STEP_KEY)  # our own keys: no part may take them
PER_RANK_KEY = "per_rank"


def capture(parts: Mapping[str, Stateful], step: int | None = None) -> dict:
    """The resume state of `parts` (and the step it is saved at) as one dict: tensors and plain values only."""
    for name, part in parts.items():
        if name in RESERVED_NAMES:
            raise ValueError(f"the part name {name!r} is reserved in a resume file")
        if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
            raise TypeError(f"part {name!r} ({type(part).__name__}) has no state_dict() / load_state_dict()")
    header = {"format": RESUME_FORMAT, "version": RESUME_VERSION} | ({STEP_KEY: step} if step is not None else {})
    return header | {name: part.state_dict() for name, part in parts.items()}


def restore(state: Mapping, parts: Mapping[str, Stateful], skip: Collection[str] = ()) -> None:
    """Load every part of `state` into `parts`, except those named in `skip` (the config part first)."""
    unknown = set(skip) - set(parts)
    if unknown:
        raise ValueError(f"cannot skip parts that are not given: {sorted(unknown)}")
    ordered = [name for name in PART_NAMES if name in parts] + [name for name in parts if name not in PART_NAMES]
    for name in ordered:
        if name not in skip:
            if name not in state:
                raise CheckpointError(f"the resume file lacks the part {name} this run needs")
            parts[name].load_state_dict(state[name])


def saved_step(state: Mapping) -> int | None:
    """The step a state was saved at: its `checkpoint_step`, or in older files the `step` part."""
    step = state.get(STEP_KEY, state.get("step"))
    return int(step) if isinstance(step, int) else None


def save_resume(path: Path, parts: Mapping[str, Stateful], step: int | None = None) -> Path:
    """Write `parts` (saved at `step`) as one resume file, atomically, with its checksum; returns `path`."""
    save_sealed(Path(path), capture(parts, step))
    return Path(path)


def load_resume(path: Path, parts: Mapping[str, Stateful], skip: Collection[str] = ()) -> int | None:
    """Verify the resume file at `path` and load it into `parts` (all but `skip`); the step it was saved at."""
    state = read_resume(path, needs=[name for name in parts if name not in skip])
    restore(state, parts, skip)
    return saved_step(state)


def check_resume_state(path: Path, state: object, needs: Collection[str] = ()) -> dict:
    """`state` as this release reads it, or CheckpointError unless it is a resume state of a version we
    read holding the parts `needs`."""
    check_format(path, state, RESUME_FORMAT, RESUME_VERSIONS, "a resume file")
    missing = [name for name in needs if name not in state]
    if missing:
        raise CheckpointError(f"{path} lacks the parts {', '.join(missing)}")
    return generator_saved_once(state)


def generator_saved_once(state: dict) -> dict:
    """A state of version 1 or 2 from many processes kept the batch generator per rank; it is the same
    on every rank, and is now saved once, as one process saves it."""
    generator = state.get("gen_state")
    if state.get("version", RESUME_VERSION) < 3 and isinstance(generator, dict) and PER_RANK_KEY in generator:
        return state | {"gen_state": generator[PER_RANK_KEY][0]}
    return state


def read_resume(path: Path, needs: Collection[str] = ()) -> dict:
    """The verified state of a resume file (checksum first, then weights_only=True), restored nowhere."""
    return check_resume_state(path, load_sealed(Path(path)), needs)


def is_per_rank(part: Stateful) -> bool:
    """A part whose state may differ between ranks says so with `per_rank = True` (our RNG part does)."""
    return getattr(part, "per_rank", False) is True


class PerRank:
    """A per-rank part saved as the list of every rank's state, and restored from this rank's entry.

    One process saves its plain state, so single-process resume files keep their layout. On resume
    with a different N, rank r takes saved rank r's state, or rank 0's when the run had fewer ranks:
    the RNG streams of ranks that did not exist start as rank 0's (they only matter for random draws
    such as dropout).
    """

    def __init__(self, part: Stateful, world: World):
        self.part, self.world = part, world

    def state_dict(self) -> Any:
        states = self.world.gather(self.part.state_dict())
        return states[0] if len(states) == 1 else {PER_RANK_KEY: states}

    def load_state_dict(self, state: Any) -> None:
        states = saved_states(state)
        self.part.load_state_dict(states[self.world.rank] if self.world.rank < len(states) else states[0])


def saved_states(state: Any) -> list:
    """The per-rank states a part was saved with (one entry for a single-process file)."""
    return state[PER_RANK_KEY] if isinstance(state, dict) and PER_RANK_KEY in state else [state]


def saved_world_size(state: Mapping) -> int:
    """How many processes wrote a resume state: the length of its per-rank parts' lists, else 1."""
    return max((len(saved_states(value)) for value in state.values()), default=1)


def per_rank(parts: Mapping[str, Stateful], world: World) -> dict[str, Stateful]:
    """`parts` as every rank saves and restores them: a per-rank part keeps every rank's state."""
    return {name: PerRank(part, world) if is_per_rank(part) else part for name, part in parts.items()}
