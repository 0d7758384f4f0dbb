"""When and how a training job saves: its periodic checkpoints (Checkpointer) and its final file.

Both go through the store's one save interface (store/access.py `make_saver`): the checkpoints into
OUT/checkpoints, synchronously or by a background thread (`--async-save`); the final resume state as
a sealed file or, with `--sharded`, a DCP folder every rank writes its shard of. Under `--shard fsdp`
a single file (a checkpoint, the weights) holds the full state, gathered from every rank's shards,
and the resume state is a DCP folder. A disk that refuses a write becomes one StorageError line
saying what is intact.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from exactresume.errors import StorageError
from exactresume.parallel.fsdp import full_model_state
from exactresume.store.access import make_saver
from exactresume.store.background import DURING_NEXT_STEP, BackgroundSaver
from exactresume.store.folder import CheckpointStore
from exactresume.store.resume import per_rank
from exactresume.store.weights import save_weights
from exactresume.training.advice import advice
from exactresume.training.joblog import RunLogs, storage_error
from exactresume.training.loop import Run
from exactresume.world import World


class Checkpointer:
    """The job's saves into its store: log rows made durable first, each step saved at most once.

    Every rank calls `save` (the per-rank parts gather every rank's state); rank 0 writes. In the
    background a save returns at once: its copy is made during the next step's forward and backward
    (copy="during-next-step"), which is exact here because the loop changes the state only in the
    optimizer's step, which waits for the copy (and a change before it would refuse the save, not
    write it). `wait` is the point where the last one is durable (the end of the run and a
    preemption call it before exiting).
    """

    def __init__(
        self,
        store: CheckpointStore,
        logs: RunLogs,
        saved_step: int | None,
        world: World = World(),
        background: bool = False,
    ):
        self.store, self.logs, self.saved_step, self.world = store, logs, saved_step, world
        self.saver = make_saver(store, world, background=background, copy=DURING_NEXT_STEP)
        self.coalesced = 0  # periodic saves skipped because the one before was still being written

    def _busy(self) -> bool:
        writer = getattr(self.saver, "writer", self.saver)  # rank 0's writer under many processes
        return isinstance(writer, BackgroundSaver) and writer.busy()

    def save(self, run: Run, coalesce: bool = False) -> Path | None:
        """Save the run's step (at most once); with `coalesce`, skip it (None) while a background save is busy."""
        step = run.step.value
        if coalesce and self.world.any(self._busy()):  # every rank skips together: the save is collective
            self.coalesced += 1
            return None
        if step != self.saved_step:
            self.logs.sync()
            with self._stopping_on_error(step):
                self.saver.save(step, per_rank(run.file_parts(), self.world))
            self.saved_step = step
        return self.store.path_for(step)

    def wait(self) -> None:
        with self._stopping_on_error(self.saved_step):
            self.saver.wait()

    @contextlib.contextmanager
    def _stopping_on_error(self, step: int | None):
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
            raise storage_error(
                f"the checkpoint at step {step} in {self.store.folder}", error, self._intact(error)
            ) from None

    def _intact(self, error: BaseException) -> str:
        existing = self.store.checkpoints()
        newest = f"{existing[-1].path} is intact" if existing else "no earlier checkpoint exists"
        return f"; training stopped, {newest} ({advice(error)})"


def write_outputs(run: Run, resume_file: Path | None, weights_file: Path, sharded: bool, world: World) -> None:
    """The resume file or folder when given, else the weights file (rank 0 writes it); every rank takes part."""
    path = resume_file or weights_file
    try:
        if resume_file is not None:
            parts = run.parts() if sharded else run.file_parts()
            make_saver(resume_file, world, sharded=sharded).save(run.step.value, per_rank(parts, world))
        else:
            weights = full_model_state(run.model)  # gathered from every rank under FSDP2
            if world.is_main:
                save_weights(weights_file, weights)
    except OSError as error:
        raise storage_error(str(path), error, "; nothing half-written was left") from None
