"""How a store lays out each checkpoint: one sealed file, or a sharded folder every rank writes its shard of.

    ONE_FILE.name(30)   -> "step-00000030.pth"   (rank 0 writes it: sealed.py)
    SHARDED.name(30)    -> "step-00000030.dcp"   (a folder, or a prefix of objects: sharded.py)

The step is zero-padded so that names sort like steps. Whatever holds the checkpoints (a folder on a
disk, an `s3://` prefix), the names are these, and a checkpoint's state holds the step its name says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from exactresume.atomic import TMP_SUFFIX
from exactresume.errors import CheckpointError
from exactresume.store.locations import Checkpoint
from exactresume.store.resume import STEP_KEY, check_resume_state

UNREADABLE_SUFFIX = ".unreadable"  # a checkpoint set aside rather than written over
# Why a save sets aside a checkpoint that reads: the load before passed it over (another run's, in a local tier).
PASSED_OVER = "the load before passed it over: damaged, sealed otherwise, or another run's"
COMMIT = "commit.pth"  # in a sharded checkpoint: the checksum of every file, written last (sharded.py)


def set_aside_line(path: object, aside: str, why: str) -> str:
    """What a save says when it renames the checkpoint at its name rather than write over it."""
    return f"set aside {path} as {aside}, kept and never read, before writing this run's checkpoint there ({why})"


@dataclass(frozen=True)
class Layout:
    """The names of a store's checkpoints and whether each is a sharded folder (every rank writes its shard)."""

    suffix: str
    sharded: bool

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(rf"^step-(\d{{8,}}){re.escape(self.suffix)}$")

    def name(self, step: int) -> str:
        """The checkpoint's name at `step`."""
        return f"step-{step:08d}{self.suffix}"

    def step_of(self, name: str) -> int | None:
        """The step a checkpoint's name says, or None when `name` is not one of this layout's."""
        found = self.pattern.match(name)
        return int(found.group(1)) if found else None


ONE_FILE = Layout(".pth", sharded=False)
SHARDED = Layout(".dcp", sharded=True)
LAYOUTS = (ONE_FILE, SHARDED)


def checkpoint_name(step: int) -> str:
    """The file name of the one-file checkpoint at `step`."""
    return ONE_FILE.name(step)


def check_checkpoint(checkpoint: Checkpoint, state: Any) -> dict:
    """`state` as a store checkpoint of `checkpoint.step`, else CheckpointError."""
    state = check_resume_state(checkpoint.path, state)
    if state.get(STEP_KEY) != checkpoint.step:
        raise CheckpointError(f"{checkpoint.path}: holds step {state.get(STEP_KEY)}, not the step its name says")
    return state


def is_store_name(name: str) -> bool:
    """A name a store takes for its own in its folder: a checkpoint of either layout, one being written (its
    temporary name), or one set aside."""
    written = name.removesuffix(TMP_SUFFIX)
    return any(layout.step_of(written) is not None for layout in LAYOUTS) or is_set_aside(name)


def is_set_aside(name: str) -> bool:
    """`step-….pth.unreadable` or `step-….dcp.unreadable`, or `….unreadable.N` when that name was taken."""
    checkpoint, found, number = name.partition(UNREADABLE_SUFFIX)
    named = any(layout.step_of(checkpoint) is not None for layout in LAYOUTS)
    return bool(found and named and (not number or re.fullmatch(r"\.\d+", number)))
