"""The resume file: every part a run needs to continue exactly, captured, saved, verified, restored.

Layout (a plain dict of tensors and Python values, so `torch.load(path, weights_only=True)` reads it):
`{"format", "version", "config", "model", "optimizer", "step", "gen_state", "rng"}`, one key per part,
and `scaler` (the GradScaler) in fp16 runs only. Weights are stored in fp32 as trained, never
rounded. `gen_state` is the data position of whichever loader the run uses. A file holds no
gradients: it is written only between optimizer steps, never inside gradient accumulation.
`restore(..., skip=...)` leaves parts out on purpose: the lab's `--no-optim` and `--no-skip` are
this same code with one part skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Collection, Mapping

from .errors import CheckpointError
from .parts import Stateful
from .sealed import load_sealed, save_sealed

RESUME_FORMAT = "exactresume.resume"
RESUME_VERSION = 1
# config first: a resume file from a different run is refused before anything is overwritten.
PART_NAMES = ("config", "model", "optimizer", "scaler", "step", "gen_state", "rng")
OPTIONAL_PARTS = ("scaler",)  # held only by runs that have one; the config says which


def capture(parts: Mapping[str, Stateful]) -> dict:
    """The resume state of `parts` as one dict: tensors and plain Python values only."""
    return {"format": RESUME_FORMAT, "version": RESUME_VERSION} | {name: part.state_dict() for name, part in parts.items()}


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
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        kind = "a weights file" if isinstance(state, dict) and any(".weight" in str(k) for k in state) else "not an exactresume resume file"
        raise CheckpointError(f"{path} is {kind}, not a resume file")
    if state.get("version") != RESUME_VERSION:
        raise CheckpointError(f"{path} has resume format version {state.get('version')}; this exactresume reads version {RESUME_VERSION}")
    missing = [name for name in PART_NAMES if name not in state and name not in OPTIONAL_PARTS]
    if missing:
        raise CheckpointError(f"{path} lacks the parts {', '.join(missing)}")
    return state


def load_resume(path: Path) -> dict:
    """Verify the checksum, load with weights_only=True, and check it is a complete resume file."""
    return check_resume_state(path, load_sealed(Path(path)))
