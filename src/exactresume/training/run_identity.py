"""The built-in trainer's run identity as a part: its config, saved and checked at a resume, and the
one line that names what differs."""

from __future__ import annotations

from typing import Any

from exactresume.errors import CheckpointError
from exactresume.store.identity import differing_fields
from exactresume.training.job import ALLOWED_CHANGES


class RunIdentity:
    """What makes two runs the same run; restoring it checks, and refuses a different run.

    `allowed` names fields (dotted, e.g. "train.steps") a resume may change on purpose; the
    differences it let through are in `accepted` after a restore. The identity saved from then on
    is the current one, so later resumes check against the changed run.
    `defaults` holds the values of fields added after a file was written: a file without such a
    field was written by a run that behaved as its default does.
    """

    def __init__(self, identity: dict, allowed: frozenset[str] = frozenset(), defaults: dict | None = None):
        self.identity, self.allowed, self.defaults = identity, allowed, defaults or {}
        self.accepted: list[tuple[str, Any, Any]] = []

    def state_dict(self) -> dict:
        return self.identity

    def load_state_dict(self, state: dict) -> None:
        differences = differing_fields(_with_defaults(state, self.defaults), self.identity, missing=None)
        refused = [difference for difference in differences if difference[0] not in self.allowed]
        if refused:
            error = CheckpointError(
                f"the resume file was made by a different run: {'; '.join(map(describe, refused))}{_way_out(refused)}"
            )
            error.names_its_way_out = True  # the flag, not the library's skip= (store.resume.restore)
            raise error
        self.accepted = differences


def _way_out(refused: list[tuple[str, Any, Any]]) -> str:
    """The --allow-change flags that would let these differences through, where there are any."""
    fields = {difference[0] for difference in refused}
    flags = [f"--allow-change {name}" for name, field in ALLOWED_CHANGES.items() if field in fields]
    return (
        f" ({' '.join(flags)} lets the resume change {'it' if len(flags) == 1 else 'them'} on purpose)" if flags else ""
    )


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved` with the fields it lacks in each section taken from `defaults` (saved values win)."""
    return {key: defaults.get(key, {}) | value if isinstance(value, dict) else value for key, value in saved.items()}


def describe(difference: tuple[str, Any, Any]) -> str:
    """'field saved-value in file, current-value now'."""
    field, old, new = difference
    return f"{field} {_short(old)} in file, {_short(new)} now"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 20 else text[:16] + "...'"
