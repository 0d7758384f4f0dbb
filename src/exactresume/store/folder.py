"""A folder of numbered checkpoints that survives kill -9, full disks and damaged files.

    store = CheckpointStore("runs/a/checkpoints", keep=3)
    step = store.load(parts)       # newest valid checkpoint into `parts`: its step, or None when there is none
    store.save(step, parts)        # FOLDER/step-00000030.pth, durable and verified; older ones pruned

`parts` maps names to objects with `state_dict()` / `load_state_dict()` (a model, an optimizer, a
batch generator wrapper, `GlobalRng()`, ...). A checkpoint is a resume file (resume.py) plus the
step it was saved at, sealed with its checksum (sealed.py): `torch.load(path, weights_only=True)`
gives every part under its name, as its object's `state_dict()`.
`save` is one sequence of stages, each a fault-injection point (faults.py; the write itself is
atomic.atomic_write's):

    snapshot -> write (serialize + checksum) -> fsync -> rename -> folder fsync -> verify -> retention

so a kill at any moment leaves either no new file or a complete one, and older checkpoints are
deleted only after the new one is durable and reads back with the right checksum. `restore` walks
from the newest checkpoint down and skips (and reports) any file that is damaged, foreign or from an
interrupted copy. One process writes a store; that process removes `.tmp` leftovers of a crashed
save when it loads.

One writer per folder is enforced: the first save, or a load that cleans up, locks the folder
(lock.py) until `close()` (or the end of a `with` block, or of the process); a second store writing
the same folder, in this process or another, is refused with a UserError naming the holder. A store
inside a folder its caller has locked already (a training job's output folder) is given that lock
(`lock=`) and takes none of its own. Listing and `load_newest` take no lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exactresume.atomic import TMP_SUFFIX, atomic_write, fsync_path
from exactresume.errors import CheckpointError, ReadBackError
from exactresume.store.faults import FaultPoints
from exactresume.store.lock import FolderLock
from exactresume.store.resume import STEP_KEY, capture, check_resume_state, restore

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful
from exactresume.store.sealed import load_sealed, verify, write_sealed

CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.pth$")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step`: zero-padded so names sort like steps."""
    return f"step-{step:08d}.pth"


def print_to_stderr(message: str) -> None:
    print(f"exactresume: {message}", file=sys.stderr)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint file of a store and the step its name says it holds."""

    step: int
    path: Path


class CheckpointStore:
    """Numbered checkpoints in one folder: save, list, restore the newest valid one, keep the newest `keep`."""

    def __init__(
        self,
        folder: Path | str,
        keep: int | None = 3,
        notify: Callable[[str], None] = print_to_stderr,
        lock: FolderLock | None = None,
    ):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep every checkpoint), got {keep}")
        self.folder, self.keep, self.notify = Path(folder), keep, notify
        self.faults = FaultPoints.from_environment()
        self.lock, self.owns_lock = lock, lock is None  # a caller's lock on a folder that holds this one

    def hold_lock(self) -> None:
        """Lock the folder for this store's writes (at once if it is free, else UserError)."""
        if self.lock is None:
            self.lock = FolderLock.acquire(self.folder)

    def close(self) -> None:
        """Let another store write the folder (the Saver interface's end)."""
        if self.lock is not None and self.owns_lock:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def path_for(self, step: int) -> Path:
        return self.folder / checkpoint_name(step)

    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoint files in the folder, oldest step first (names only; nothing is read)."""
        if not self.folder.is_dir():
            return []
        found = (CHECKPOINT_NAME.match(entry.name) for entry in os.scandir(self.folder) if entry.is_file())
        return sorted((Checkpoint(int(m.group(1)), self.folder / m.group(0)) for m in found if m), key=lambda c: c.step)

    def leftovers(self) -> list[Path]:
        """`.tmp` files in the folder: saves that a crash interrupted before their rename."""
        if not self.folder.is_dir():
            return []
        return sorted(self.folder / entry.name for entry in os.scandir(self.folder) if entry.name.endswith(TMP_SUFFIX))

    def remove_leftovers(self) -> list[Path]:
        """Delete the `.tmp` leftovers of interrupted saves; returns what was removed."""
        if self.folder.is_dir():
            self.hold_lock()
        removed = self.leftovers()
        for path in removed:
            path.unlink(missing_ok=True)
        if removed:
            fsync_path(self.folder)
        return removed

    # -- saving: one sequence of stages, each a fault-injection point ---------------------------

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Path:
        """Write `parts` as the checkpoint at `step`, durably and verified, then prune old ones."""
        self.faults.reached("snapshot")
        return self.commit(step, snapshot(step, parts))

    def commit(self, step: int, state: dict) -> Path:
        """The stages after the snapshot: write, fsync, rename, folder fsync, verify, retention.

        `state` must not change while this runs (background.py hands it a private copy).
        """
        path = self.path_for(step)
        self._ensure_folder()
        self.hold_lock()
        self._write(path, state)
        self._verify_written(path)
        self._retain(step)
        return path

    def _ensure_folder(self) -> None:
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True)
            fsync_path(self.folder.parent)

    def _write(self, path: Path, state: dict) -> None:
        """serialize + checksum -> fsync -> rename -> folder fsync; on any failure no new file remains."""
        reached: list[str] = []

        def stage(name: str) -> None:
            reached.append(name)
            self.faults.reached(name)

        try:
            atomic_write(path, lambda file: write_sealed(file, state), stage, expected_bytes=_tensor_bytes(state))
        except BaseException:
            if "folder-fsync" in reached:
                _remove_quietly(path)  # a rename we could not make durable is not a checkpoint
            raise

    def _verify_written(self, path: Path) -> None:
        """Read the new file back and check its checksum; a file that fails is removed."""
        try:
            self.faults.reached("verify")
            verify(path)
        except OSError:
            _remove_quietly(path)
            raise
        except CheckpointError as error:
            _remove_quietly(path)
            raise ReadBackError(errno.EIO, f"the checkpoint read back damaged ({error})") from None

    def _retain(self, step: int) -> None:
        """Delete all but the newest `keep` checkpoints up to `step`; a failure here only warns."""
        if self.keep is None:
            return
        older = [c for c in self.checkpoints() if c.step <= step][: -self.keep]
        try:
            self.faults.reached("retention")
            for checkpoint in older:
                checkpoint.path.unlink(missing_ok=True)
            if older:
                fsync_path(self.folder)
        except OSError as error:
            self.notify(f"warning: could not delete old checkpoints in {self.folder}: {error.strerror or error}")

    def wait(self) -> None:
        """Nothing to wait for: `save` returns once the checkpoint is durable (the Saver interface)."""

    # -- restoring ---------------------------------------------------------------------------------

    def load_newest(self, names: Collection[str]) -> tuple[Checkpoint, dict] | None:
        """The newest checkpoint that verifies and holds every part in `names`, with its state."""
        for checkpoint in reversed(self.checkpoints()):
            try:
                return checkpoint, check_checkpoint(checkpoint, load_sealed(checkpoint.path), names)
            except CheckpointError as error:
                self.notify(f"skipping damaged checkpoint {error}")
        return None

    def load(self, parts: Mapping[str, Stateful], skip: Collection[str] = (), clean: bool = True) -> int | None:
        """Load the newest valid checkpoint into `parts` (except `skip`): its step, or None when there is none.

        With `clean` (the writer) it first locks the folder and removes `.tmp` leftovers; without (a
        reader, such as another rank of a run whose rank 0 writes) it takes no lock.

        A run's identity mismatch (a `RunIdentity` part) raises CheckpointError rather than falling
        back to an older file: an older file of a different run is no better.
        """
        if clean:
            self.remove_leftovers()
        found = self.load_newest([name for name in parts if name not in skip])
        if found is None:
            return None
        checkpoint, state = found
        restore(state, parts, skip=skip)
        return checkpoint.step


def snapshot(step: int, parts: Mapping[str, Stateful]) -> dict:
    """The state to write: every part's state_dict and the step.

    The tensors are references to the live ones, not copies: fine while `save` runs before the next
    step; a writer in the background works on a copy (background.py).
    """
    return capture(parts, step)


def check_checkpoint(checkpoint: Checkpoint, state: Any, names: Collection[str]) -> dict:
    """`state` as a store checkpoint of `checkpoint.step` holding `names`, else CheckpointError."""
    state = check_resume_state(checkpoint.path, state, names)
    if state.get(STEP_KEY) != checkpoint.step:
        raise CheckpointError(f"{checkpoint.path}: holds step {state.get(STEP_KEY)}, not the step its name says")
    return state


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
