"""A run's identity: what the user says makes a run this run (a seed, its total steps, its data), kept
with each checkpoint and checked before one is loaded.

    store = CheckpointStore(folder, identity={"seed": 0, "steps": 120})   # saved with each checkpoint, checked by load
    save_resume(path, parts, step, identity={...}); load_resume(path, parts, identity={...})

The built-in trainer knows its run from its config part (training/run_identity.py RunIdentity); a loop of
one's own has no such part, so without an identity a script started with another seed would go on
from the first seed's checkpoint without a word. A checkpoint holds the identity beside its parts,
under IDENTITY_KEY, as JSON text: one string is stored alike in a file, in DCP's items and in an
object (DCP would flatten a dict and lose an empty one), and a plain `torch.load(weights_only=True)`
reads it (`json.loads` gives the dict back). Only a save given an identity writes the key, so the
trainer's and the lab's files keep their keys. A load given an identity refuses, in one line naming
each field that differs, before any part is loaded; `identity=None` checks nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from exactresume.errors import CheckpointError, FieldError

IDENTITY_KEY = "identity"  # beside the parts in a file saved with identity=; no part may take the name
LOAD_ANYWAY = "pass identity=None, or give this run's own file"  # the way out of a one-file load
ABSENT = object()  # a field on one side only
_LONGEST = 40  # characters of a value shown in a refusal


def check_identity(identity: Any) -> dict | None:
    """`identity` as a load compares it: None, or a dict of str keys whose values JSON keeps as they are
    (a tuple would come back a list, NaN unequal to itself); FieldError otherwise."""
    if identity is None:
        return None
    if not isinstance(identity, dict) or not all(isinstance(key, str) for key in identity):
        raise FieldError(
            f"identity must be a dict of str keys (seed, steps, data, ...), got {identity!r:.80}", "identity"
        )
    try:
        kept = json.loads(_identity_text(identity))
    except (TypeError, ValueError) as error:
        raise FieldError(
            f"identity must hold JSON values only (numbers, strings, lists, dicts): {error}", "identity"
        ) from None
    if kept != identity:
        raise FieldError(
            f"identity changes when written as JSON (a tuple, a key that is not a str, NaN): {identity!r:.80}",
            "identity",
        )
    return kept  # the store's own copy: the caller's dict may change after it is given


def _identity_text(identity: dict) -> str:
    """The stored form: JSON with sorted keys, so that equal identities are equal text."""
    return json.dumps(identity, sort_keys=True)


def with_identity(state: dict, identity: dict | None) -> dict:
    """`state` with `identity` beside its parts; without one, `state` itself, its keys as they were."""
    return state if identity is None else state | {IDENTITY_KEY: _identity_text(identity)}


def _saved_identity(state: Mapping, source: object) -> dict | None:
    """The identity a checkpoint was saved with, or None when it was saved without one."""
    text = state.get(IDENTITY_KEY)
    if text is None:
        return None
    try:
        saved = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{source}: its {IDENTITY_KEY} is not the JSON text of a dict")
    return saved


def refuse_another_run(state: Mapping, identity: dict | None, source: object, anyway: str = LOAD_ANYWAY) -> None:
    """CheckpointError when an `identity` is given and `state` was saved with another, naming each field
    that differs (saved vs given) and how to load `anyway`. A checkpoint saved without one is refused too:
    nothing then says it is this run's, which is the question identity= asks; the way out loads it once,
    and the checkpoints saved from then on record the identity."""
    if identity is None:
        return
    saved = _saved_identity(state, source)
    if saved is None:
        reason = f"{source} records no run identity (it was saved without identity=), so it may be another run's"
    else:
        differences = differing_fields(saved, identity)
        if not differences:
            return
        reason = f"{source} was saved by another run: {'; '.join(map(_told, differences))}"
    raise CheckpointError(f"{reason}; nothing was loaded. To load it anyway, {anyway}")


def differing_fields(saved: Mapping, given: Mapping, missing: Any = ABSENT, prefix: str = "") -> list[tuple]:
    """(dotted field, saved value, given value) for every leaf that differs between two nested dicts; a
    field on one side only has `missing` on the other (ABSENT: it differs; None: as a field set to None)."""
    differences = []
    for key in sorted(set(saved) | set(given)):
        old, new = saved.get(key, missing), given.get(key, missing)
        if isinstance(old, dict) and isinstance(new, dict):
            differences += differing_fields(old, new, missing, f"{prefix}{key}.")
        elif old != new:  # ABSENT equals nothing but itself
            differences.append((f"{prefix}{key}", old, new))
    return differences


def _told(difference: tuple) -> str:
    field, old, new = difference
    return f"{field}: saved {_shown(old)}, given {_shown(new)}"


def _shown(value: Any) -> str:
    if value is ABSENT:
        return "nothing"
    text = repr(value)
    return text if len(text) <= _LONGEST else text[: _LONGEST - 3] + "..."


__all__ = [
    "IDENTITY_KEY",
    "LOAD_ANYWAY",
    "check_identity",
    "differing_fields",
    "refuse_another_run",
    "with_identity",
]
