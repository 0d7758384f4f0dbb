"""Whether a saved state fits the parts it is loaded into, said in one line before anything is loaded.

Two questions, asked before the first `load_state_dict` so that a refusal changes nothing:

- the names: every part the file holds is given (or skipped), and every part given is in the file
  (or skipped, or new since the save and allowed to start fresh);
- the tensors: where a saved tensor and the part's current one sit at the same place, their shapes
  and dtypes agree; a module's keys are the same on both sides (PyTorch's own check would copy half
  the tensors first and then raise a message of many lines).
- an optimizer's hyperparameters: its saved param_groups hold every one this optimizer steps with
  (torch loads another kind's state without a word, and the first step raises a KeyError).

A part that still fails in its own `load_state_dict` is caught by the caller (resume.restore), which
puts back every part it already loaded.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from exactresume.errors import CheckpointError
from exactresume.store.identity import IDENTITY_KEY

# beside the parts in every file (the identity in those saved with one); resume.RESERVED_NAMES
OWN_KEYS = ("format", "version", "checkpoint_step", IDENTITY_KEY)
SHOWN = 4  # names listed in a message before "and N more"


def _saved_parts(state: Mapping) -> list[str]:
    """The names of the parts a resume state holds (its own keys left out)."""
    return [name for name in state if name not in OWN_KEYS]


def check_names(
    where: str, state: Mapping, given: Collection[str], skip: Collection[str] = (), fresh: Collection[str] = ()
) -> list[str]:
    """The given parts that start fresh (in `fresh`, absent from the file); CheckpointError when the
    names differ in any other way, naming both sides and how to load anyway."""
    saved = _saved_parts(state)
    unknown = set(fresh) - set(given)
    if unknown:
        raise CheckpointError(f"fresh= names parts that are not given: {_all(sorted(unknown))}")
    nowhere = set(skip) - set(given) - set(saved)
    if nowhere:  # a misspelt name would otherwise skip nothing, unsaid
        raise CheckpointError(f"skip= names parts neither given nor in {where}: {_all(sorted(nowhere))}")
    absent = [name for name in given if name not in state and name not in skip]
    unread = [name for name in saved if name not in given and name not in skip]
    starting = [name for name in absent if name in fresh]
    absent = [name for name in absent if name not in fresh]
    if absent or unread:
        raise CheckpointError(_mismatch(where, saved, list(given), absent, unread))
    return starting


def _mismatch(where: str, saved: list[str], given: list[str], absent: list[str], unread: list[str]) -> str:
    sides = [f"{where} holds the parts {_all(saved)}; the parts given are {_all(given)}"]
    if absent:
        sides.append(f"{_all(absent)} {_is_are(absent)} not in the checkpoint")
    if unread:
        sides.append(f"{_all(unread)} {_is_are(unread)} not given")
    ways = [f"a renamed part under its saved name ({_all(unread)})"] if absent and unread else []
    both = [f"fresh={absent!r} to start {_as_now(absent)}"] if absent else []
    both += [f"skip={unread!r} to leave {_it_them(unread)} unread"] if unread else []
    return "; ".join(sides) + "; nothing was loaded. To load anyway, give " + " or ".join([*ways, " and ".join(both)])


def check_tensors(name: str, saved: Any, part: Any, source: object) -> None:
    """CheckpointError naming the tensors of `saved` that do not fit the part's current state: for a
    module, which copies the saved tensors into its own, and an optimizer, whose state belongs to
    parameters of fixed shapes; any other part may change its tensors' shapes as it likes."""
    part = getattr(part, "sharded_module", part)  # a module sharded over the ranks (sharded.py), as itself
    if not isinstance(part, (torch.nn.Module, torch.optim.Optimizer)):
        return
    current = part.state_dict()
    problems = list(_module_keys(saved, current)) if isinstance(part, torch.nn.Module) else []
    problems += list(_hyperparameters(saved, part)) if isinstance(part, torch.optim.Optimizer) else []
    problems += [f"{path}: {why}" for path, why in _tensor_misfits(saved, current, name)]
    if problems:
        more = f" and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        # an optimizer that no longer fits (another kind, other parameters) may be what the loop meant
        fresh = (
            f"; skip=[{name!r}] loads the rest and starts {name} fresh"
            if isinstance(part, torch.optim.Optimizer)
            else ""
        )
        raise CheckpointError(
            f"the part {name} does not fit {source}: {'; '.join(problems[:SHOWN])}{more}; nothing was loaded{fresh}"
        )


def _module_keys(saved: Any, current: Mapping) -> Iterator[str]:
    if not isinstance(saved, Mapping):
        yield f"the saved state is a {type(saved).__name__}, not a module's state dict"
        return
    missing = [key for key in current if key not in saved]
    unexpected = [key for key in saved if key not in current]
    if missing:
        yield f"the saved state lacks {_names(missing)}"
    if unexpected:
        yield f"the module has no {_names(unexpected)}"


def _hyperparameters(saved: Any, optimizer: torch.optim.Optimizer) -> Iterator[str]:
    """What an optimizer steps with that its saved param_groups lack, once torch filled in what newer
    versions of the same optimizer added (its own __setstate__, run on a copy): saved by another kind."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not groups or not isinstance(groups, list) or not all(isinstance(group, Mapping) for group in groups):
        return
    probe = object.__new__(type(optimizer))
    try:
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {}, "param_groups": list(map(dict, groups))})
        filled = set().union(*(group.keys() for group in probe.param_groups))
    except Exception:  # an optimizer of one's own whose __setstate__ wants more: its load will say
        return
    lacking = sorted(set(optimizer.defaults) - filled)
    if lacking:
        held = sorted(set().union(*(group.keys() for group in groups)) - set(optimizer.defaults) - {"params"})
        kind = f" (saved by another optimizer? they hold {_names(held)})" if held else ""
        yield f"its saved param_groups lack {_names(lacking)}, which {type(optimizer).__name__} steps with{kind}"


def _tensor_misfits(saved: Any, current: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, why) wherever both sides hold a plain tensor at `path` and its shape or dtype differs."""
    if _plain_tensor(saved) and isinstance(current, torch.Tensor):  # a DTensor's shape is its whole one
        if saved.shape != current.shape:
            yield path, f"saved {list(saved.shape)}, given {list(current.shape)}"
        elif saved.dtype != current.dtype:
            yield path, f"saved {_dtype(saved)}, given {_dtype(current)}"
    elif isinstance(saved, Mapping) and isinstance(current, Mapping):
        for key in saved:
            if key in current:
                yield from _tensor_misfits(saved[key], current[key], f"{path}.{key}")
    elif isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) and len(saved) == len(current):
        for index, (old, new) in enumerate(zip(saved, current)):
            yield from _tensor_misfits(old, new, f"{path}.{index}")


def _plain_tensor(value: Any) -> bool:
    # A saved DTensor was read into this rank's rows as the run shards it now (a sharded load's
    # destination): it fits by construction.
    return isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "") if names else "none"


def _all(names: list[str]) -> str:
    return ", ".join(names) or "none"


def _is_are(names: list) -> str:
    return "is" if len(names) == 1 else "are"


def _it_them(names: list) -> str:
    return "it" if len(names) == 1 else "them"


def _as_now(names: list) -> str:
    return "it as it is now" if len(names) == 1 else "them as they are now"
