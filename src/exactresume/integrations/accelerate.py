"""Accelerate: one call on the prepared loader makes `save_state` / `load_state` resume exactly mid-epoch.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader = accelerate_resume(accelerator, loader)
    ...
    accelerator.load_state(folder)       # then iterate `loader`: it continues where the loop stopped
    for batch in loader: ...

No `skip_first_batches`: the loader opens at the first batch the loop did not take, reading none of
the others, in the order the uninterrupted run drew. Each process writes its state into the folder
`save_state` writes (`exactresume-rank0.pt`, sealed), through Accelerate's save and load hooks; the
folder stays Accelerate's own, and `load_state` without this line reads it as it always has. Each
`save_state` then writes its folder whole or not at all (accelerate_atomic).
"""

from __future__ import annotations

from pathlib import Path

from exactresume.errors import CheckpointError, FieldError, UserError, a_kind_of, notice
from exactresume.store.sealed import load_sealed, save_sealed

from . import shard as shards
from .accelerate_atomic import atomic_saves
from .loop_state import LoopState

NAME = "accelerate_resume"
COUNT = "_exactresume_loaders"
SUPPORTED = "0.32"  # the oldest Accelerate with both state hooks and the shard's base_dataloader


def accelerate_resume(accelerator, loader):
    """`loader` (from `accelerator.prepare`), made to resume exactly through save_state and load_state."""
    _check_arguments(accelerator, loader)
    try:
        if not hasattr(accelerator, "register_save_state_pre_hook"):
            raise UserError(f"this Accelerate has no save_state hooks (it supports Accelerate {SUPPORTED} on)")
        atomic_saves(accelerator)  # whatever becomes of the loader: every save whole or absent
        state = shards.read_through(loader)
    except UserError as error:
        twice = "twice" in str(error)
        notice(f"{NAME}: {error}" + ("" if twice else _standing_aside(accelerator)))
        return loader
    made = getattr(accelerator, COUNT, 0)  # loaders made resumable on this accelerator before: each its own file
    setattr(accelerator, COUNT, made + 1)
    name = shards.state_file(accelerator.process_index, made)
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: _save(state, Path(folder) / name))
    accelerator.register_load_state_pre_hook(lambda models, folder: _load(loader, state, Path(folder) / name))
    return loader


def _check_arguments(accelerator, loader) -> None:
    """FieldError for what is no Accelerator or no DataLoader at all (swapped, None): a mistake in the call,
    not a loader the line stands aside for."""
    from torch.utils.data import DataLoader

    if not (hasattr(accelerator, "save_state") and hasattr(accelerator, "prepare")):
        raise FieldError(
            f"{NAME}(accelerator, loader) takes the Accelerator first, got {a_kind_of(accelerator)}",
            "accelerator",
        )
    if not isinstance(loader, DataLoader):
        raise FieldError(
            f"{NAME}(accelerator, loader) takes the DataLoader accelerator.prepare returned, got {a_kind_of(loader)}",
            "loader",
        )


def _standing_aside(accelerator) -> str:
    if hasattr(accelerator, "register_save_state_pre_hook"):
        return "; this loader resumes as Accelerate alone resumes it (its saves are still made whole or absent)"
    return "; the run goes on as Accelerate alone runs it"


def _save(state: LoopState, path: Path) -> None:
    if state.loader.resuming:  # its position is the loaded one: kept, a resume from it would be wrong
        notice(
            f"{NAME}: the loop did not read the loader since load_state (did it read another, as skip_first_batches "
            f"makes?): nothing of it is saved in {path.parent}, which resumes as Accelerate's own; iterate the "
            "loader accelerate_resume returned"
        )
        return
    save_sealed(path, state.state_dict(shards.taken(state)))


def _load(loader, state: LoopState, path: Path) -> None:
    if not path.exists():
        notice(
            f"{NAME}: {path.parent} holds no {path.name} (saved without it, or its save cut short), so it resumes "
            "as Accelerate resumes it: the loader from "
            "its epoch's first batch (unless skip_first_batches), the RNG before the loader draws from it"
        )
        return
    try:
        state.load_state_dict(load_sealed(path))
    except CheckpointError as error:
        notice(f"{NAME}: {error}; this resume is Accelerate's own")
        return
    shards.set_epoch(loader, state)
