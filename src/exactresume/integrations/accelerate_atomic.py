"""Accelerate's `save_state`, made atomic: a process killed while it writes leaves every checkpoint
folder as it was, never one cut short that `load_state` fails on.

`save_state` writes its files into the folder one by one (the weights, the optimizer, each process's
RNG, ours). With the line it writes them into `.exactresume-partial/` one level above the folder's
parent (for `ckpt/step_5`: `.exactresume-partial/ckpt/step_5`), outside the folder a loop lists to
find its newest checkpoint, and outside `checkpoints/` under automatic_checkpoint_naming, where
Accelerate's own listing would take it for one. Once every process has written, the files are made
durable and the folder is put at its name in one rename, over the old one if there was one; the
oldest beyond `total_limit` are removed only then.
"""

from __future__ import annotations

import contextlib
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
    original = accelerator.save_state

    def save_state(output_dir=None, safe_serialization: bool = True, **kwargs):
        target = _target(accelerator, output_dir)
        if target is None or (target.exists() and _automatic(accelerator)):  # Accelerate's own refusal, as it words it
            return original(output_dir, safe_serialization, **kwargs)
        staging = _staging(target)
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
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

    accelerator.save_state = save_state


def _automatic(accelerator) -> bool:
    return bool(accelerator.project_configuration.automatic_checkpoint_naming)


def _target(accelerator, output_dir) -> Path | None:
    """The folder Accelerate would write; None where it writes none we can stage (it then raises, or it is remote)."""
    if _automatic(accelerator):
        return Path(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}").absolute()
    if output_dir is None or "://" in str(output_dir):
        return None
    return Path(output_dir).expanduser().absolute()


def _staging(target: Path) -> Path:
    """Where `target` is written before its rename: beside its parent, on the same disk (a rename cannot cross)."""
    parent = target.parent
    above = parent.parent if parent.parent != parent else parent
    if above.exists() and parent.exists() and above.stat().st_dev != parent.stat().st_dev:
        above = parent  # the parent is a disk of its own: stage inside it
    return above / PARTIAL / parent.name / target.name


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
    for empty in (staging.parent, staging.parent.parent):
        with contextlib.suppress(OSError):
            empty.rmdir()
    if keep is not None:
        _prune(target, keep)


def _prune(new: Path, keep: int) -> None:
    """As Accelerate prunes before it saves (the lowest numbers first, beside the new one `keep` - 1 at most),
    but after the new checkpoint is in place."""
    others = [folder for folder in new.parent.iterdir() if folder != new]
    others.sort(key=lambda folder: int("".join(filter(str.isdigit, folder.name)) or -1))
    for folder in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(folder)
