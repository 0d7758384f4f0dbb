"""What a training job's saves mean when the disk refuses them, and its final file.

The job saves its periodic checkpoints with its CheckpointStore's own `save` (in the background with
`--async-save`, every rank calling it), and its final resume state with `save_resume` (a sealed file
or, with `--sharded`, a DCP folder every rank writes its shard of). Under `--shard fsdp` a single
file (a checkpoint, the weights) holds the full state, gathered from every rank's shards, and the
resume state is a DCP folder. A disk that refuses a write becomes one StorageError line saying what
is intact and that training stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from exactresume.errors import StorageError
from exactresume.parallel.fsdp import full_model_state
from exactresume.store.access import save_resume
from exactresume.store.numbered import CheckpointStore
from exactresume.store.weights import save_weights
from exactresume.training.advice import advice
from exactresume.training.loop import Run
from exactresume.world import World


@contextlib.contextmanager
def stopping_on_error(store: CheckpointStore, step: int | None) -> Iterator[None]:
    """A refused checkpoint write, raised as one StorageError line that says training stopped."""
    try:
        yield
    except StorageError as refused:  # the store's line (an earlier step's, from the background): what is intact
        raise stopped(refused) from None
    except OSError as error:  # a writer that leaves its OSError as it is
        raise stopped(store.storage_error(step, error)) from None


def stopped(refused: StorageError) -> StorageError:
    """The store's line for a refused write, and that training stopped, with the next step that fits."""
    cause = refused.__cause__
    if not isinstance(cause, OSError):
        raise refused
    line = StorageError(f"{refused}; training stopped ({advice(cause)})")
    line.errno = refused.errno
    return line


def write_outputs(run: Run, resume_file: Path | None, weights_file: Path, sharded: bool, world: World) -> None:
    """The resume file or folder when given, else the weights file (rank 0 writes it); every rank takes part."""
    path = resume_file or weights_file
    try:
        if resume_file is not None:
            parts = run.parts() if sharded else run.file_parts()
            save_resume(resume_file, parts, run.step.value, sharded=sharded, world=world)
        else:
            weights = full_model_state(run.model)  # gathered from every rank under FSDP2
            if world.is_main:
                save_weights(weights_file, weights)
    except OSError as error:
        raise StorageError.from_os_error(str(path), error, "; nothing half-written was left") from None
