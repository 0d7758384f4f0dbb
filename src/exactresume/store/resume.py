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

import copy
import functools
import operator
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exactresume.errors import CheckpointError, FieldError, UserError, a_kind_of, notice
from exactresume.store.containers import CONTAINERS_KEY
from exactresume.store.fit import check_names, check_tensors
from exactresume.store.formats import RESUME_FORMAT, RESUME_VERSION, RESUME_VERSIONS, check_format
from exactresume.store.identity import IDENTITY_KEY, with_identity
from exactresume.store.sealed import load_sealed
from exactresume.world import World

if TYPE_CHECKING:  # PyTorch's own part protocol, DCP's: importing DCP costs a second, so only for types
    from torch.distributed.checkpoint.stateful import Stateful

# config first: a resume file from a different run is refused before anything is overwritten.
PART_NAMES = ("config", "model", "optimizer", "scaler", "step", "gen_state", "rng")
OPTIONAL_PARTS = ("scaler",)  # held only by runs that have one; the config says which
STEP_KEY = "checkpoint_step"  # beside the parts in every file: the step it was saved at
# our own keys: no part may take them (CONTAINERS_KEY: a sharded checkpoint's record of its containers)
RESERVED_NAMES = ("format", "version", STEP_KEY, IDENTITY_KEY, CONTAINERS_KEY)
PER_RANK_KEY = "per_rank"
IMMUTABLE = frozenset({int, float, str, bytes, bool, type(None)})  # what a copy would give back as it is


def capture(parts: Mapping[str, Stateful], step: int | None = None, identity: dict | None = None) -> dict:
    """The resume state of `parts` (and the step it is saved at, and the run's identity: identity.py) as
    one dict: tensors and plain values only."""
    header = {"format": RESUME_FORMAT, "version": RESUME_VERSION}
    if step is not None:
        header[STEP_KEY] = check_step(step)
    return with_identity(header, identity) | {name: part.state_dict() for name, part in parts.items()}


def check_parts(parts: Any) -> None:
    """FieldError unless `parts` maps names to objects with `state_dict()` and `load_state_dict()`. Called
    where parts enter, by the public calls (access.py, the stores' save and load); the rest trusts them."""
    if not isinstance(parts, Mapping):
        raise FieldError(f"parts must be a dict of name -> part, got {a_kind_of(parts)}", "parts")
    for name, part in parts.items():
        if not isinstance(name, str) or name in RESERVED_NAMES:
            reserved = ", ".join(RESERVED_NAMES)
            raise FieldError(f"parts: {name!r} cannot name a part (a string; {reserved} are reserved)", "parts")
        if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
            raise FieldError(f"parts: {name} ({type(part).__name__}) has no state_dict() / load_state_dict()", "parts")


def for_one_file(parts: Mapping[str, Stateful], world: World, instead: str) -> dict[str, Stateful]:
    """`parts` as a save of one file by rank 0 of `world` takes them (`per_rank`), once what one file
    cannot hold is refused (`_check_one_file`) and what it leaves out is said (`_note_one_rank`)."""
    _check_one_file(parts, instead)
    _note_one_rank(parts, world)
    return per_rank(parts, world)


def _check_one_file(parts: Mapping[str, Stateful], instead: str) -> None:
    """UserError when a part's parameters are sharded over the ranks (FSDP2's DTensors): one file would
    hold rank 0's shards only, pickled as objects a plain torch.load refuses; the line names the call
    to use `instead`. Every rank checks, before any collective, so that none is left waiting."""
    for name, part in parts.items():
        for where, parameter in _parameters(part):
            if is_dtensor(parameter):
                raise UserError(
                    f"the part {name} is sharded over the ranks ({where} is a DTensor, FSDP2's): one file "
                    f"cannot hold it; save it with {instead}, where every rank writes its shard"
                )


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor (FSDP2's sharded tensor), told without importing DTensor's module."""
    return type(value).__name__ == "DTensor"


def tensors_in(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            if type(value) not in IMMUTABLE:
                yield from tensors_in(value)


def _parameters(part: Stateful) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(part, torch.nn.Module):
        yield from part.named_parameters()
    elif isinstance(part, torch.optim.Optimizer):
        for index, group in enumerate(part.param_groups):
            yield from ((f"param group {index}'s parameter", parameter) for parameter in group["params"])


def _names_of(names: Collection[str] | str, field: str) -> list[str]:
    """`skip=` or `fresh=` as a list of part names: one name alone is taken as itself, not as its letters."""
    if isinstance(names, str):
        return [names]
    names = list(names)
    if not all(isinstance(name, str) for name in names):
        raise FieldError(f"{field} must name parts (strings), got {names!r}", field)
    return names


def check_step(step: Any) -> int:
    """`step` as the int a checkpoint is named after, or FieldError: a negative or fractional step is a mistake."""
    try:
        index = None if isinstance(step, bool) else operator.index(step)  # an int, numpy's or a tensor's
    except (TypeError, ValueError, RuntimeError):
        index = None
    if index is None or index < 0:
        raise FieldError(f"step must be an integer of at least 0, got {step!r}", "step")
    return index


def restore(
    state: Mapping,
    parts: Mapping[str, Stateful],
    skip: Collection[str] = (),
    fresh: Collection[str] = (),
    source: object = "the resume state",
) -> list[str]:
    """Load every part of `state` into `parts` (the config part first), all or nothing; the parts that
    started fresh.

    `skip` names parts, given or saved, to leave as they are; `fresh` names parts given that may be
    absent from `state` (new since the save): they then keep their current state. Any other difference
    of names, a tensor of another shape or dtype, or a part's own `load_state_dict` failing is a
    CheckpointError naming `source`, and every part is left as it was.
    """
    skip, fresh = _names_of(skip, "skip"), _names_of(fresh, "fresh")
    loading = [name for name in _ordered(parts) if name not in skip and name in state]
    loaded: dict[str, Any] = {}  # each part's state before it loaded, to put back if a later one fails
    try:
        # A file of another run is refused as such first: its parts may differ for that reason alone.
        _load_parts(state, parts, loading[:1] if loading[:1] == ["config"] else [], loaded)
        starting = check_names(str(source), state, parts, skip, fresh)
        for name in loading:
            check_tensors(name, state[name], parts[name], source)
        _load_parts(state, parts, [name for name in loading if name not in loaded], loaded)
    except Exception as error:
        stuck = _put_back(parts, loaded)
        failed = getattr(error, "part_name", "?")
        told = getattr(error, "names_its_way_out", False)  # a refusal that names its own way out keeps it
        if isinstance(error, CheckpointError) and not stuck and failed != "?" and not told:  # a part's: its way out
            raise CheckpointError(f"{error} (skip={[failed]} loads the other parts, this one left as it is)") from None
        if isinstance(error, UserError) and not stuck:
            raise
        changed = f"{', '.join(stuck)} could not be put back" if stuck else "no part was changed"
        reason = f"the part {failed} could not load its saved state from {source}, and {changed}"
        raise CheckpointError(f"{reason}: {_one_line(error)}") from error
    return starting


def _load_parts(state: Mapping, parts: Mapping[str, Stateful], names: list[str], loaded: dict[str, Any]) -> None:
    for name in names:
        try:
            before = _detached_copy(_own_state(parts[name]))
            loaded[name] = before
            parts[name].load_state_dict(state[name])
        except Exception as error:
            error.part_name = name  # which part the message names
            raise


def _ordered(parts: Mapping[str, Stateful]) -> list[str]:
    return [name for name in PART_NAMES if name in parts] + [name for name in parts if name not in PART_NAMES]


def _own_state(part: Stateful) -> Any:
    """The state of this process's own object (a per-rank part's without gathering every rank's)."""
    return part.part.state_dict() if isinstance(part, PerRank) else part.state_dict()


def _detached_copy(value: Any) -> Any:
    """`value` with every tensor copied (to the CPU where it is a plain tensor): what a rollback loads."""
    return rebuilt(value, _copied)


def _copied(tensor: torch.Tensor) -> torch.Tensor:
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)  # a DTensor stays where its shards are
    return tensor.detach().to("cpu", copy=True) if plain else tensor.detach().clone()


def rebuilt(value: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with its dicts, lists and tuples remade, each tensor replaced by `tensor(it)`, every other
    value deep-copied (numpy RNG arrays: small) but the immutable ones, kept as they are."""
    if type(value) in IMMUTABLE:
        return value
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, dict):
        copied = copy.copy(value)  # keeps the type and attributes (a state dict's _metadata)
        for key, item in value.items():
            copied[key] = rebuilt(item, tensor)
        return copied
    if isinstance(value, list):
        return [rebuilt(item, tensor) for item in value]
    if type(value) is tuple:
        if all(type(item) in IMMUTABLE for item in value):  # Python's RNG state: 625 ints
            return value
        return tuple(rebuilt(item, tensor) for item in value)
    return copy.deepcopy(value)


def _put_back(parts: Mapping[str, Stateful], loaded: Mapping[str, Any]) -> list[str]:
    """Load each part's state from before the restore back into it; the parts that refused even that."""
    stuck = []
    for name, before in loaded.items():
        part = parts[name]
        try:
            (part.part if isinstance(part, PerRank) else part).load_state_dict(before)
        except Exception:  # a part that cannot take its own state back; named in the error
            stuck.append(name)
    return stuck


def _one_line(error: BaseException) -> str:
    if type(error) is KeyError and len(error.args) == 1:  # its text is the key alone: 'state.0.step'
        return f"no key {error.args[0]!r} where one was looked up (KeyError)"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines) or type(error).__name__


def started_fresh(source: object, name: str) -> str:
    """The line that says a part given but not in `source` kept its own state (`fresh=`)."""
    return f"{source} holds no part {name}: it starts fresh (fresh=)"


def saved_step(state: Mapping) -> int | None:
    """The step a state was saved at: its `checkpoint_step`, or in older files the `step` part."""
    step = state.get(STEP_KEY, state.get("step"))
    return int(step) if isinstance(step, int) else None


def check_resume_state(path: Path, state: object, needs: Collection[str] = ()) -> dict:
    """`state` as this release reads it, or CheckpointError unless it is a resume state of a version we
    read holding the parts `needs`."""
    check_format(path, state, RESUME_FORMAT, RESUME_VERSIONS, "a resume file")
    missing = [name for name in needs if name not in state]
    if missing:
        raise CheckpointError(f"{path} lacks the parts {', '.join(missing)}")
    return _generator_saved_once(state)


def _generator_saved_once(state: dict) -> dict:
    """A state of version 1 or 2 from many processes kept the batch generator per rank; it is the same
    on every rank, and is now saved once, as one process saves it."""
    generator = state.get("gen_state")
    if state.get("version", RESUME_VERSION) < 3 and isinstance(generator, dict) and PER_RANK_KEY in generator:
        return state | {"gen_state": generator[PER_RANK_KEY][0]}
    return state


def read_resume_file(path: Path, needs: Collection[str] = ()) -> dict:
    """The verified state of a local resume file (checksum first, then weights_only=True), restored nowhere."""
    return check_resume_state(path, load_sealed(Path(path)), needs)


def _is_per_rank(part: Stateful) -> bool:
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
        states = _saved_states(state)
        self.part.load_state_dict(states[self.world.rank] if self.world.rank < len(states) else states[0])


def _saved_states(state: Any) -> list:
    """The per-rank states a part was saved with (one entry for a single-process file)."""
    return state[PER_RANK_KEY] if isinstance(state, dict) and PER_RANK_KEY in state else [state]


def saved_world_size(state: Mapping) -> int:
    """How many processes wrote a resume state: the length of its per-rank parts' lists, else 1."""
    return max((len(_saved_states(value)) for value in state.values()), default=1)


def per_rank(parts: Mapping[str, Stateful], world: World) -> dict[str, Stateful]:
    """`parts` as every rank saves and restores them: a per-rank part keeps every rank's state."""
    return {name: PerRank(part, world) if _is_per_rank(part) else part for name, part in parts.items()}


def _note_one_rank(parts: Mapping[str, Stateful], world: World) -> None:
    """Under torchrun, a save given no world keeps this rank's state of the per-rank parts only: say so,
    once per process, naming them (the other ranks' states are not in the file)."""
    torchrun = World.from_env()
    names = [name for name, part in parts.items() if _is_per_rank(part)]
    if world.size == 1 and torchrun.size > 1 and names:
        _notice_once(
            f"rank {torchrun.rank} of {torchrun.size} saves {', '.join(names)} without world=: the file keeps "
            "this rank's state of them only; give world=World.from_env() on every rank to keep each rank's"
        )


@functools.cache
def _notice_once(message: str) -> None:
    notice(message)
