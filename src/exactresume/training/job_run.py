"""A TrainJob running in this process (JobRun): it owns what the job holds while it runs.

    outcome = JobRun(job, world, progress).run()   # every rank calls it; rank 0 writes

The lock on OUT (rank 0; a checkpoint folder inside OUT is locked too), the process group, the logs, the
checkpoint store, the progress line and the divergence log; the loop calls back into it after each
step. The source is opened by the store's one way in (store/access.py `open_resume`); the
checkpoints go out through the CheckpointStore's own `save`, the final file through `save_resume`
(saving.py); the logs and the job's lines are joblog.py's. Under many
processes (parallel/) every rank runs the job: every rank builds and restores its replica and takes
part in each save (the per-rank parts are gathered from all), only rank 0 writes the files and the
logs; with `sharded` (always under `--shard fsdp`) every rank writes its shard of OUT/resume.dcp, and
under `--shard fsdp` of each checkpoint (no gather).

How it ends: the finished run (exit 0); a user's mistake (UserError, 2); a disk that refuses a write
(StorageError, 74: the previous checkpoint is intact and nothing half-written is left); SIGTERM or
SIGINT: an outcome whose `preempted` says where the checkpoint of the finished step was saved (75).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from exactresume.atomic import ensure_writable_folder, tmp_path
from exactresume.core.data import load_tokens
from exactresume.core.steplog import read_loss_log
from exactresume.errors import UserError, listed
from exactresume.parallel.fsdp import shard_destinations
from exactresume.parallel.replicas import process_group
from exactresume.parallel.replicate import replicate
from exactresume.progress import Progress
from exactresume.store.access import open_resume, resumed_from
from exactresume.store.background import DURING_NEXT_STEP
from exactresume.store.locations import is_s3
from exactresume.store.lock import FolderLock
from exactresume.store.numbered import CheckpointStore
from exactresume.training.divergence import DivergenceLog
from exactresume.training.job import ALLOWED_CHANGES, AUTO_RESUME, TrainJob
from exactresume.training.joblog import RunLogs, ignore, note, warn
from exactresume.training.loop import Run, StepRecord, build_run, lr_at, train
from exactresume.training.preemption import Preempted, PreemptionGuard
from exactresume.training.run_identity import describe
from exactresume.training.saving import stopping_on_error, write_outputs
from exactresume.world import World


@dataclass
class JobOutcome:
    """How a job ended: the finished (or stopped) run, and the signal that stopped it, if one did."""

    run: Run
    preempted: Preempted | None = None


class JobRun:
    """One TrainJob running in this process: its lock, logs, checkpoint store and hooks, the loop's callback."""

    def __init__(self, job: TrainJob, world: World, progress: Progress):
        self.job, self.world, self.progress = job, world, progress
        self.notify = warn if world.is_main else ignore
        self.guard = PreemptionGuard()
        self.run_state: Run | None = None  # built by `run`, then stepped
        self.divergence: DivergenceLog | None = None
        self.store: CheckpointStore | None = None  # opened by `run`
        self.identity = {"out": str(job.out.resolve())}  # whose checkpoints a local tier's are (store/tiers.py)
        self.saved_step: int | None = None  # the step last checkpointed: each step is saved at most once

    def run(self) -> JobOutcome:
        with self._lock() as lock, process_group(self.world):
            self._check_outputs()  # every rank, once rank 0 holds OUT and the ranks have met
            with self._store(lock) as store:  # its close releases an s3:// prefix's lease
                self.store = store
                if self.world.is_main:
                    self._remove_leftovers(store)
                self.world.barrier()  # no rank reads the store while rank 0 clears it
                self.run_state = self.prepare(self.job.skip_parts)
                self._check_saves_may_run(store)
                self.divergence = self._divergence_log()
                with RunLogs(self.job.log_file, self.job.samples, self.run_state.step.value, self.world) as self.logs:
                    outcome = self._train(store)
        if self.divergence is not None and outcome.preempted is None:
            self.divergence.write()
        return outcome

    def _lock(self) -> contextlib.AbstractContextManager:
        if not self.world.is_main:  # rank 0 writes OUT; the other ranks only take part
            return contextlib.nullcontext()
        return FolderLock.acquire(self.job.out, wait=self.job.wait_lock, notify=warn)

    def _store(self, lock: FolderLock | None) -> CheckpointStore:
        """The job's checkpoints, saved by every rank together; an s3:// prefix's lease is waited for as
        OUT's lock is (--wait-lock).

        In the background (`--async-save`) a save returns at once: its copy is made during the next
        step's forward and backward, which is exact here because the loop changes the state only in
        the optimizer's step, which waits for the copy (a change before it would refuse the save)."""
        job = self.job
        wait = {"wait_lock": job.wait_lock} if is_s3(job.checkpoint_folder) else {}
        background = job.async_save is not None
        copy, serializer = (DURING_NEXT_STEP, job.async_save) if background else (None, None)
        # Under FSDP2 every rank writes its shard of each checkpoint: nothing is gathered on one rank.
        options = {"background": background, "copy": copy, "serializer": serializer, "world": self.world, **wait}
        options["sharded"] = job.config.fsdp
        if job.local_checkpoints is not None:  # a local checkpoint is this run's when it was written into OUT's run
            tiers = {"local": job.local_checkpoints, "durable_every": job.durable_every, "identity": self.identity}
            options |= tiers
        folder = job.checkpoint_folder
        # A folder inside OUT takes its own lock, as one elsewhere does: another run given it is refused.
        # OUT itself (--checkpoints OUT) is held already, by this process.
        same = isinstance(folder, Path) and os.path.realpath(folder) == os.path.realpath(job.out)
        return CheckpointStore(folder, keep=job.keep, notify=self.notify, lock=lock if same else None, **options)

    def _check_outputs(self) -> None:
        job = self.job
        folders = [
            (job.out, "output folder"),
            (job.weights_file.parent, "--weights folder"),
            (job.log_file.parent, "--log folder"),
            *([(job.samples.parent, "--samples folder")] if job.samples else []),
        ]
        if job.save_every is not None and not is_s3(job.checkpoint_folder):
            folders.append((job.checkpoint_folder, "--checkpoints folder"))
        if job.local_checkpoints is not None:  # each rank's own, before a step is trained
            folders.append((job.local_checkpoints, "--local-checkpoints folder"))
        for folder, what in folders:
            ensure_writable_folder(folder, what)
        if job.resume is not None and job.stop_at is None and job.weights_file == job.resume:
            raise UserError(f"--weights would overwrite the resume file {job.resume}")

    def _remove_leftovers(self, store: CheckpointStore) -> None:
        """Delete `.tmp` files a crashed save of this job's outputs left behind."""
        store.remove_leftovers()
        for path in (self.job.resume_file, self.job.weights_file):
            if not is_s3(path) and not tmp_path(path).is_dir():  # a sharded save clears its own staging folder
                tmp_path(path).unlink(missing_ok=True)

    def prepare(self, skip_parts: frozenset[str], world: World | None = None) -> Run:
        """The run, built fresh as `world`'s replica (this rank's) and restored as --resume says
        (config checked first)."""
        world = world or self.world
        run = build_run(self.job.config, load_tokens(self.job.data))
        replicate(run, world)
        run.identity.allowed = frozenset(ALLOWED_CHANGES[name] for name in self.job.allow_change)
        self._restore(run, skip_parts, world)
        return run

    def _restore(self, run: Run, skip_parts: frozenset[str], world: World) -> None:
        """Every rank restores its replica, through the per-rank parts (each rank's entry of them)."""
        job = self.job
        if job.resume is None:
            return
        needs = [name for name in run.parts() if name not in skip_parts]
        # A sharded folder is read straight into this rank's shards; a single file holds the full state.
        into = shard_destinations(run.model)
        if job.resume == AUTO_RESUME and job.local_checkpoints is not None:  # the newest of both tiers
            found = self.store.newest_loadable()
            resumed = None if found is None else resumed_from(self.store, *found, needs)
        else:
            resumed = open_resume(job.resume, job.checkpoint_folder, needs, notify=self.notify, destination=into)
        if resumed is None:
            self._refuse_starting_over_a_finished_run()
            if world.is_main:
                stop_file = isinstance(job.resume_file, Path) and job.resume_file.exists()  # auto reads no such file
                hint = f" (the --stop-at file {job.resume_file} is read by --resume FILE)" if stop_file else ""
                tiers = f"{job.local_checkpoints} or " if job.local_checkpoints is not None else ""
                note(f"no checkpoint in {tiers}{job.checkpoint_folder}{hint}; starting at step 0")
            return
        parts = run.parts() if resumed.kind == "sharded" else run.file_parts()
        resumed.restore(parts, skip=skip_parts, world=world)
        if world is not self.world or not world.is_main:  # a --divergence twin (one process) says nothing
            return
        if str(resumed.path) != str(job.resume):  # the newest checkpoint of a folder
            note(f"resumed from {resumed.path} at step {resumed.step}")
        change = _world_change(resumed.saved_world_size, world.size, bool(self.job.config.micro_batch))
        if change:
            print(change)

    def _refuse_starting_over_a_finished_run(self) -> None:
        """--resume auto that finds no checkpoint starts at step 0, over the log a crashed first attempt left;
        never over a finished run's weights or its whole log (each rank sees them: every rank stops, none
        waits for another)."""
        job = self.job
        finished = [job.weights_file] if job.stop_at is None and job.weights_file.exists() else []
        finished += [job.log_file] if _logs_a_finished_run(job.log_file, job.config.steps) else []
        if finished:
            are = "is" if len(finished) == 1 else "are"
            raise UserError(
                f"no checkpoint in {job.checkpoint_folder} to resume from, and {listed(list(map(str, finished)))} "
                f"{are} a finished run's, which starting at step 0 would overwrite: give another --out, or move "
                f"{'it' if len(finished) == 1 else 'them'} out"
            )

    def _check_saves_may_run(self, store: CheckpointStore) -> None:
        """The run's checkpoints up to the step it starts at are its own; a checkpoint past it that its saves
        would refuse to write beside (another run's, or one sealed with another key) is refused now, before
        a log row is written, not at the first save."""
        start = self.run_state.step.value
        store.continue_from(start, loaded_here=self.job.resume == AUTO_RESUME)
        if self.job.save_every is not None:
            store.check_save(start + 1)

    def _divergence_log(self) -> DivergenceLog | None:
        if self.job.divergence is None or not self.world.is_main:  # rank 0 steps the twin
            return None
        # The twin is one process on the whole global batch, restored with every part.
        return DivergenceLog(self.job.divergence, self.run_state, lambda: self.prepare(frozenset(), World()))

    def _train(self, store: CheckpointStore) -> JobOutcome:
        run, job = self.run_state, self.job
        start = run.step.value
        if self.world.is_main:
            self._note_allowed_changes(start)
        until = self._target(start)
        resumed_auto = job.resume == AUTO_RESUME and start
        self.store, self.saved_step = store, start if resumed_auto else None
        self.progress.begin(start)
        try:
            with self.guard:
                train(run, until, self.after_step)
        except Preempted as stop:
            stop.saved = self._save(run)
            self._wait()
            return JobOutcome(run, stop)
        finally:
            self.progress.close()
        self._finish()
        return JobOutcome(run)

    def _save(self, run: Run, coalesce: bool = False) -> Path | None:
        """Checkpoint the run's step, at most once, its log rows made durable first; with `coalesce`,
        skip it (None) while the background save before it is being written."""
        step, store = run.step.value, self.store
        if store.skips(step, coalesce):
            return None
        if step != self.saved_step:
            self.logs.sync()
            with stopping_on_error(store, step):
                store.save(step, run.parts() if store.layout.sharded else run.file_parts())
            self.saved_step = step
        return store.path_for(step)

    def _wait(self) -> None:
        with stopping_on_error(self.store, self.saved_step):
            self.store.wait()

    def after_step(self, record: StepRecord) -> None:
        """What the job does after each optimizer step: log it, checkpoint on schedule, stop on a signal."""
        run, job = self.run_state, self.job
        self.logs.record(record)
        if self.divergence is not None:
            self.divergence.record(record)
        self.progress.update(record.step, loss=record.loss)
        if job.save_every and run.step.value % job.save_every == 0:
            # Every step in the background means as often as the disk allows: a save asked for
            # while the one before is still being written is skipped, and counted.
            self._save(run, coalesce=job.async_save is not None and job.save_every == 1)
        # The ranks agree on a signal any of them caught, so all stop after the same step and save together.
        if self.world.any(self.guard.requested):
            raise Preempted(self.guard.signal_name or "a signal to another process", run.step.value)

    def _finish(self) -> None:
        run, job = self.run_state, self.job
        if job.save_every:
            self._save(run)
            self._wait()
            if self.store.coalesced and self.world.is_main:
                skipped = self.store.coalesced
                note(f"{skipped} periodic checkpoint(s) skipped: the one before was still being written")
            if self.store.durable is not None and self.store.durable.skipped and self.world.is_main:
                left = self.store.durable.skipped
                note(f"{left} durable checkpoint(s) left to the local tier: the copy before was still going up")
        resume_file = job.resume_file if job.stop_at is not None else None
        write_outputs(run, resume_file, job.weights_file, job.writes_sharded, self.world)

    def _target(self, start: int) -> int:
        until = self.job.until
        # An auto-resumed run whose final checkpoint was already written only needs its outputs rewritten.
        if start > until or start == until and self.job.resume != AUTO_RESUME:
            raise UserError(f"the resume file is at step {start}; nothing to train up to step {until}")
        return until

    def _note_allowed_changes(self, step: int) -> None:
        accepted = self.run_state.identity.accepted
        if not accepted:
            return
        saved = {name.removeprefix("train."): old for name, old, new in accepted}
        text = "; ".join(map(describe, accepted))
        if "steps" in saved or "lr" in saved:  # the schedule is lr_at(step, steps, lr): a new total reshapes it
            config = self.job.config
            before = lr_at(step, saved.get("steps", config.steps), saved.get("lr", config.lr))
            now = lr_at(step, config.steps, config.lr)
            text += f"; lr at step {step} was {before:.4g} on the old schedule, {now:.4g} now"
        note(f"resuming with allowed changes: {text}")


def prepare_run(job: TrainJob, world: World = World()) -> Run:
    """The job's run, built and restored as it would start (no lock, no files written)."""
    return JobRun(job, world, Progress(job.until, "train", "none")).prepare(job.skip_parts)


def _world_change(saved: int, now: int, exact_mode: bool) -> str | None:
    """A note when the checkpoint was saved by another number of processes than this run has."""
    if saved == now:
        return None
    if exact_mode:
        return f"resuming a {saved}-process run on {now}: the N-independent mode, the same bits"
    return (
        f"resuming a {saved}-process run on {now}: the same samples; "
        "weights equal up to the order of floating-point reduction"
    )


def _logs_a_finished_run(log: Path, steps: int) -> bool:
    """Whether `log` holds a row for the run's last step: the log of a run that ended, not of a crashed attempt."""
    try:
        return max(read_loss_log(log), default=0) >= steps
    except (OSError, ValueError, KeyError):  # no log, or not a loss log (refused before, where it is another kind)
        return False
