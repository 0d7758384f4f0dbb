"""Accelerate's `save_state`, made atomic: a process killed while it writes leaves every checkpoint
folder as it was, never one cut short that `load_state` fails on.

`save_state` writes its files into the folder one by one (the weights, the optimizer, each process's
RNG, ours). With the line it writes them into `.exactresume-partial/` one level above the folder's
parent (for `ckpt/step_5`: `.exactresume-partial/ckpt/step_5`), outside the folder a loop lists to
find its newest checkpoint, and outside `checkpoints/` under automatic_checkpoint_naming, where
Accelerate's own listing would take it for one; inside the parent where the parent is the working
directory (a project's own folder: nothing is written above it) or the folder above cannot take it.
Once every process has written, the files are made durable and the folder is put at its name in one
rename, over the old one if there was one; the oldest beyond `total_limit` are removed only then.

Under automatic_checkpoint_naming, `load_state` leaves Accelerate's count of saves at 0: its next
`save_state` prunes the oldest and saves as `checkpoint_0`, the lowest number (or raises where that
name is still taken), so the next `load_state` takes an older checkpoint than the last one saved.
With the line `load_state` sets the count after the newest checkpoint (the number the uninterrupted
run saves next), and a save among the checkpoints of a run it did not load (at or past its number)
is refused before anything is pruned.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from exactresume.atomic import fsync_tree, replace_folder

PARTIAL = ".exactresume-partial"
MADE = "_exactresume_atomic_saves"


def atomic_saves(accelerator) -> None:
    """Make `accelerator.save_state` write each checkpoint folder whole or not at all (once per accelerator)."""
    if getattr(accelerator, MADE, False):
        return
    setattr(accelerator, MADE, True)
    original, original_load = accelerator.save_state, accelerator.load_state

    def save_state(output_dir=None, safe_serialization: bool = True, **kwargs):
        target = _target(accelerator, output_dir)
        if target is None:
            return original(output_dir, safe_serialization, **kwargs)
        if _automatic(accelerator):
            _refuse_another_runs_checkpoints(target)
        staging = _staging(target)
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
            _make_staging(staging)
        accelerator.wait_for_everyone()
        with _naming_off(accelerator):
            original(str(staging), safe_serialization, **kwargs)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _commit(staging, target, accelerator.project_configuration.total_limit if _automatic(accelerator) else None)
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process and staging.exists():  # a node that does not share the main's disk
            _commit(staging, target, None)
        return str(target)

    def load_state(input_dir=None, **kwargs):
        loaded = original_load(input_dir, **kwargs)
        if _automatic(accelerator):
            _count_after_newest(accelerator)
        return loaded

    accelerator.save_state, accelerator.load_state = save_state, load_state


def _automatic(accelerator) -> bool:
    return bool(accelerator.project_configuration.automatic_checkpoint_naming)


def _refuse_another_runs_checkpoints(target: Path) -> None:
    """ValueError, before anything is written or pruned, where `checkpoints/` holds `target` or a later
    number: the checkpoints of a run this one did not load_state (Accelerate alone would prune them as
    its own, and save among them)."""
    numbers = _numbers(target.parent)
    if numbers and max(numbers) >= _number(target.name):
        raise ValueError(
            f"{target.parent} holds checkpoint_{max(numbers)}, at or past {target.name} that this save would "
            "write; nothing was saved or removed: load_state() first to continue that run (it sets the count), "
            "set accelerator.project_configuration.iteration, or use another project folder"
        )


def _numbers(folder: Path) -> list[int]:
    """The numbers of the checkpoint folders in `folder` (none where it does not exist)."""
    names = os.listdir(folder) if folder.is_dir() else []
    return [number for name in names if (number := _number(name)) is not None]


def _number(name: str) -> int | None:
    """The number of a checkpoint folder named `checkpoint_N`, as Accelerate reads it: its first digits."""
    found = re.search(r"\d+", name)
    return int(found.group()) if found else None


def _count_after_newest(accelerator) -> None:
    """Accelerate's count of saves after the newest `checkpoints/checkpoint_N`: N + 1, where the
    uninterrupted run's next save goes (never lowered, never onto a folder that exists)."""
    numbers = _numbers(Path(accelerator.project_dir, "checkpoints"))
    configuration = accelerator.project_configuration
    configuration.iteration = max([configuration.iteration, *(number + 1 for number in numbers)])


def _target(accelerator, output_dir) -> Path | None:
    """The folder Accelerate would write; None where it writes none we can stage (it then raises, or it is remote)."""
    if _automatic(accelerator):
        return Path(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}").absolute()
    if output_dir is None or "://" in str(output_dir):
        return None
    return Path(output_dir).expanduser().absolute()


def _staging(target: Path) -> Path:
    """Where `target` is written before its rename: beside its parent, on the same disk (a rename cannot
    cross); inside the parent where that is the working directory, or the folder above is not fit."""
    parent = target.parent
    above = parent.parent
    if parent == Path.cwd() or above == parent or not _fit_for_staging(above, parent):
        return parent / PARTIAL / target.name
    return above / PARTIAL / parent.name / target.name


def _fit_for_staging(above: Path, parent: Path) -> bool:
    """Whether `above` can be written and lies on `parent`'s disk (checked where they exist yet)."""
    if not above.exists():
        return True  # made with the checkpoint's parent
    if not os.access(above, os.W_OK):
        return False
    return not parent.exists() or above.stat().st_dev == parent.stat().st_dev


def _make_staging(staging: Path, tries: int = 8) -> None:
    """`mkdir -p staging`, again where another run's save, done meanwhile, removed an empty folder on the
    way (its `.exactresume-partial`): once `staging` exists, no such cleanup can remove what holds it."""
    for attempt in range(tries):
        try:
            staging.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == tries - 1:
                raise


@contextlib.contextmanager
def _naming_off(accelerator):
    """automatic_checkpoint_naming off for one call: save_state then writes the folder it is given."""
    configuration = accelerator.project_configuration
    automatic = configuration.automatic_checkpoint_naming
    configuration.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        configuration.automatic_checkpoint_naming = automatic


def _commit(staging: Path, target: Path, keep: int | None) -> None:
    fsync_tree(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_folder(staging, target)
    partial = next(folder for folder in staging.parents if folder.name == PARTIAL)
    for empty in dict.fromkeys((staging.parent, partial)):  # left where no other save is staged
        with contextlib.suppress(OSError):
            empty.rmdir()
    if keep is not None:
        _prune(target, keep)


def _prune(new: Path, keep: int) -> None:
    """As Accelerate prunes before it saves (the lowest numbers first, beside the new one `keep` - 1 at most),
    but after the new checkpoint is in place."""
    others = [folder for folder in new.parent.iterdir() if folder != new]
    others.sort(key=lambda folder: -1 if (number := _number(folder.name)) is None else number)
    for folder in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(folder)
