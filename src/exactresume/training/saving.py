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
from exactresume.store.folder import CheckpointStore
from exactresume.store.weights import save_weights
from exactresume.training.advice import advice
from exactresume.training.joblog import storage_error
from exactresume.training.loop import Run
from exactresume.world import World


@contextlib.contextmanager
def stopping_on_error(store: CheckpointStore, step: int | None) -> Iterator[None]:
    """A refused checkpoint write, raised as one StorageError line that says training stopped."""
    try:
        yield
    except StorageError as refused:  # the store's line (an earlier step's, from the background): what is intact
        cause = refused.__cause__
        if not isinstance(cause, OSError):
            raise
        stopped = StorageError(f"{refused}; training stopped ({advice(cause)})")
        stopped.errno = refused.errno
        raise stopped from None
    except OSError as error:  # a writer that leaves its OSError as it is
        raise storage_error(f"the checkpoint at step {step} in {store.folder}", error, _intact(store, error)) from None


def _intact(store: CheckpointStore, error: BaseException) -> str:
    existing = store.checkpoints()
    newest = f"{existing[-1].path} is intact" if existing else "no earlier checkpoint exists"
    return f"; training stopped, {newest} ({advice(error)})"


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
        raise storage_error(str(path), error, "; nothing half-written was left") from None
