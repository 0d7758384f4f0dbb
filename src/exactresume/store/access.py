"""One way in and out of the store for a training job: save every rank's parts as a sealed resume
file or a sharded DCP folder, and verify and restore either.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from exactresume.store.resume import Stateful, capture, load_resume, restore, saved_world_size
from exactresume.store.sealed import save_sealed
from exactresume.world import World


def is_sharded_folder(path: Path) -> bool:
    """A folder holding DCP's files (its index, shards or our commit marker): a --sharded checkpoint."""
    path = Path(path)
    return path.is_dir() and (
        (path / ".metadata").exists() or any(path.glob("*.distcp")) or (path / "commit.pth").exists()
    )


def save_checkpoint(path: Path, parts: Mapping[str, Stateful], world: World, sharded: bool) -> None:
    """Every rank calls this: a sealed resume file written by rank 0, or a DCP folder of every rank's shard."""
    if sharded:
        from exactresume.store.sharded import save_sharded  # DCP takes a second to import: only when used

        save_sharded(Path(path), parts, world)
        return
    state = capture(parts)  # the per-rank parts gather every rank's state here
    if world.is_main:
        save_sealed(Path(path), state)
    world.barrier()


def restore_checkpoint(
    path: Path, parts: Mapping[str, Stateful], skip: Collection[str], world: World, log=print
) -> dict:
    """Verify and load a resume file or sharded folder into `parts` (all but `skip`); returns the state."""
    path = Path(path)
    if path.is_dir():
        from exactresume.store.sharded import load_sharded, sharded_parts

        state, parts = load_sharded(path), sharded_parts(parts)
    else:
        state = load_resume(path)
    restore(state, parts, skip=skip)
    saved = saved_world_size(state)
    if saved != world.size and world.is_main:
        log(
            f"resuming a {saved}-process run on {world.size}: the same samples; "
            "weights equal up to the order of floating-point reduction"
        )
    return state
