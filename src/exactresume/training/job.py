"""One `exactresume train` invocation: a run plus its files.

Loads the prepared data, builds the run, optionally restores it (from a resume file, a checkpoint
folder, or with `--resume auto` from the newest valid checkpoint in OUT/checkpoints), trains to
`--stop-at` or `--steps` while appending each step's log rows, saves a checkpoint every
`--save-every` steps and when preempted, and writes the resume file or the weights file at the end.

Under many processes (distributed.py) every rank runs the job: every rank builds and restores its
replica and takes part in each save (the per-rank parts are gathered from all), only rank 0 writes
the files and the logs; with `sharded` every rank writes its shard of OUT/resume.dcp.

Exit paths: done (0); a user's mistake (UserError, 2); a disk that refuses a write (StorageError,
74: the previous checkpoint is intact and nothing half-written is left); SIGTERM/SIGINT (Preempted,
75: a checkpoint of the finished step is saved).
"""

from __future__ import annotations

import contextlib
import errno
import sys
from dataclasses import dataclass, field
from pathlib import Path

from exactresume.atomic import ensure_writable_folder, tmp_path
from exactresume.config import TrainConfig, check_stop_at
from exactresume.core.data import load_tokens
from exactresume.dist.replicas import replicate
from exactresume.errors import CheckpointError, StorageError, UserError
from exactresume.store.access import is_sharded_folder, restore_checkpoint, save_checkpoint
from exactresume.store.background import BackgroundSaveFailed, BackgroundSaver
from exactresume.store.folder import CheckpointStore, snapshot
from exactresume.store.resume import PART_NAMES, per_rank, restore
from exactresume.store.steplog import LOSS_HEADER, SAMPLES_HEADER, StepLog
from exactresume.store.weights import save_weights
from exactresume.training.loop import Run, StepRecord, build_run, lr_at, train
from exactresume.training.parts import describe
from exactresume.training.preemption import Preempted, PreemptionGuard
from exactresume.world import World

AUTO_RESUME = "auto"  # --resume auto: the newest valid checkpoint in OUT/checkpoints, or a fresh start
# --allow-change names -> the run-identity fields they let a resume change. Model shape and seed are
# not here: a different shape cannot load, and the seed only matters before step 1.
ALLOWED_CHANGES = {
    "steps": "train.steps",
    "lr": "train.lr",
    "batch": "train.batch",
    "seq-len": "train.seq_len",
    "data": "data",
}


@dataclass(frozen=True)
class TrainJob:
    """Where a training run reads and writes, how it checkpoints, and which parts a resume leaves out."""

    config: TrainConfig
    data: Path
    out: Path
    stop_at: int | None = None  # stop after this global step and write out/resume.pth
    resume: Path | str | None = None  # a resume file, a checkpoint folder, or AUTO_RESUME
    skip_parts: frozenset[str] = field(default_factory=frozenset)  # parts not restored (ablations)
    weights: Path | None = None  # default out/final.pth
    log: Path | None = None  # default out/log.csv
    samples: Path | None = None  # optional `step,starts` log of the windows each step trained on
    save_every: int | None = None  # also checkpoint to out/checkpoints every N steps and at the end
    keep: int | None = 3  # newest checkpoints kept in out/checkpoints; None keeps all
    allow_change: frozenset[str] = field(default_factory=frozenset)  # keys of ALLOWED_CHANGES
    async_save: bool = False  # periodic checkpoints written by a background thread (background.py)
    sharded: bool = False  # write the resume state as a DCP folder, out/resume.dcp, each rank its shard

    def __post_init__(self) -> None:
        if self.stop_at is not None:
            check_stop_at(self.stop_at, self.config.steps)
        if self.skip_parts and self.resume is None:
            raise UserError("--no-optim and --no-skip only make sense with --resume")
        if self.save_every is not None and self.save_every < 1:
            raise UserError(f"--save-every must be at least 1, got {self.save_every}")
        if self.async_save and self.save_every is None:
            raise UserError("--async-save needs --save-every N: it changes how the periodic checkpoints are written")
        if self.keep is not None and self.keep < 1:
            raise UserError(f"--keep must be at least 1 (0 keeps every checkpoint), got {self.keep}")
        unknown = sorted(set(self.allow_change) - set(ALLOWED_CHANGES))
        if unknown:
            raise UserError(f"--allow-change {unknown[0]}: only {', '.join(ALLOWED_CHANGES)} may change on resume")
        if self.sharded and self.stop_at is None:
            raise UserError("--sharded only makes sense with --stop-at (it is how the resume state is written)")

    @property
    def resume_file(self) -> Path:
        return self.out / ("resume.dcp" if self.sharded else "resume.pth")

    @property
    def checkpoint_folder(self) -> Path:
        return self.out / "checkpoints"

    @property
    def weights_file(self) -> Path:
        return self.weights or self.out / "final.pth"

    @property
    def log_file(self) -> Path:
        return self.log or self.out / "log.csv"


def note(message: str) -> None:
    """A line on stdout about what the job did (where it resumed from)."""
    print(f"exactresume train: {message}", flush=True)


def warn(message: str) -> None:
    """A line on stderr about something the user should know (a damaged checkpoint skipped)."""
    print(f"exactresume train: {message}", file=sys.stderr, flush=True)


def storage_error(what: str, error: OSError, after: str = "") -> StorageError:
    """A one-line StorageError: what could not be written, why (with the errno name), what is intact."""
    code = errno.errorcode.get(error.errno or 0)
    reason = f"{error.strerror or error}" + (f" ({code})" if code and code not in str(error.strerror) else "")
    return StorageError(f"could not write {what}: {reason}{after}")


class RunLogs:
    """This process's loss log and optional samples log, trimmed to the resumed step, one row per step."""

    def __init__(self, job: TrainJob, resumed_step: int, world: World = World()):
        self.logs: list[StepLog] = []
        if not world.is_main:  # rank 0 logs the global batch and the loss averaged over ranks
            return
        # Both files are checked before either is touched: a refusal changes nothing.
        self.logs = [StepLog(job.log_file, LOSS_HEADER, resumed_step)]
        if job.samples:
            self.logs.append(StepLog(job.samples, SAMPLES_HEADER, resumed_step))

    def __enter__(self) -> RunLogs:
        for log in self.logs:
            with self._writing(log):
                log.open()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for log in self.logs:
            with contextlib.suppress(OSError) if kind else self._writing(log):
                log.close()

    def record(self, record: StepRecord) -> None:
        rows = (f"{record.loss:.6f}", " ".join(str(int(s)) for s in record.starts))
        for log, row in zip(self.logs, rows):
            with self._writing(log):
                log.append(record.step, row)

    def sync(self) -> None:
        for log in self.logs:
            with self._writing(log):
                log.sync()

    @contextlib.contextmanager
    def _writing(self, log: StepLog):
        try:
            yield
        except OSError as error:
            raise storage_error(f"the log {log.path}", error, "; training stopped (rerun with --resume auto)") from None


class Checkpointer:
    """The job's saves into its store: log rows made durable first, each step saved at most once.

    Every rank calls `save` (the per-rank parts gather every rank's state); rank 0 writes. With a
    BackgroundSaver a save returns at once (its copy is made during the next step); `wait` is the
    point where the last one is durable (the end of the run and a preemption call it before exiting).
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
        self.background = BackgroundSaver(store) if background and world.is_main else None

    def save(self, run: Run, coalesce: bool = False) -> Path | None:
        """Save the run's step (at most once); with `coalesce`, skip it (None) while a background save is busy."""
        step = run.step.value
        busy = self.background is not None and self.background.busy()
        if coalesce and self.world.any(busy):  # every rank skips together: the save is collective
            if self.background is not None:
                self.background.coalesced += 1
            return None
        if step != self.saved_step:
            self.logs.sync()
            parts = per_rank(run.parts(), self.world)
            with self._stopping_on_error(step):
                if self.world.is_main:
                    (self.background or self.store).save(step, parts)
                else:
                    snapshot(step, parts)  # takes part in gathering the per-rank parts; rank 0 writes
            self.world.barrier()
            self.saved_step = step
        return self.store.path_for(step)

    def wait(self) -> None:
        if self.background is not None:
            with self._stopping_on_error(self.saved_step):
                self.background.wait()

    @contextlib.contextmanager
    def _stopping_on_error(self, step: int | None):
        try:
            yield
        except BackgroundSaveFailed as failed:  # an earlier step's save, found out now
            if not isinstance(failed.error, OSError):
                raise failed.error from None
            raise storage_error(
                f"the checkpoint at step {failed.step} in {self.store.folder}", failed.error, self._intact()
            ) from None
        except OSError as error:
            raise storage_error(
                f"the checkpoint at step {step} in {self.store.folder}", error, self._intact()
            ) from None

    def _intact(self) -> str:
        existing = self.store.checkpoints()
        newest = f"{existing[-1].path} is intact" if existing else "no earlier checkpoint exists"
        return f"; training stopped, {newest} (free space, then rerun with --resume auto)"


def _check_outputs(job: TrainJob) -> None:
    folders = [job.out, job.weights_file.parent, job.log_file.parent] + ([job.samples.parent] if job.samples else [])
    if job.save_every is not None:
        folders.append(job.checkpoint_folder)
    for folder in folders:
        ensure_writable_folder(folder)
    if job.resume is not None and job.stop_at is None and job.weights_file == job.resume:
        raise UserError(f"--weights would overwrite the resume file {job.resume}")


def _remove_leftovers(job: TrainJob, store: CheckpointStore) -> None:
    """Delete `.tmp` files a crashed save of this job's outputs left behind."""
    store.remove_leftovers()
    for path in (job.resume_file, job.weights_file):
        if not tmp_path(path).is_dir():  # a sharded save clears its own staging folder
            tmp_path(path).unlink(missing_ok=True)


def _restore_from_folder(folder: Path, parts: dict, skip: frozenset[str], world: World) -> int:
    """--resume FOLDER: the newest valid checkpoint in someone's checkpoint folder (nothing is deleted there)."""
    skipped: list[str] = []
    store = CheckpointStore(folder, keep=None, notify=skipped.append)
    found = store.load_newest([name for name in PART_NAMES if name not in skip])
    if found is None:
        details = [f"only {len(store.leftovers())} .tmp leftover(s) of interrupted saves"] if store.leftovers() else []
        details += skipped[:1] + ([f"and {len(skipped) - 1} more damaged"] if len(skipped) > 1 else [])
        raise CheckpointError("; ".join([f"{folder} holds no complete checkpoint", *details]))
    checkpoint, state = found
    restore(state, parts, skip=skip)
    if world.is_main:
        for message in skipped:
            warn(message)
        note(f"resumed from {checkpoint.path} at step {checkpoint.step}")
    return checkpoint.step


def resume_run(job: TrainJob, run: Run, store: CheckpointStore, world: World = World()) -> int:
    """Restore the run as --resume says (config checked first); the step it continues from.

    Every rank restores its replica, through `world.parts` (each rank's entry of the per-rank parts).
    A folder holding DCP's files is a sharded checkpoint (--sharded); any other folder a checkpoint store.
    """
    if job.resume is None:
        return 0
    parts = per_rank(run.parts(), world)
    if job.resume == AUTO_RESUME:
        step = store.restore(parts, skip=job.skip_parts)
        if world.is_main:
            note(
                f"resumed from {store.path_for(step)} at step {step}"
                if step
                else f"no checkpoint in {store.folder}; starting at step 0"
            )
        return step
    path = Path(job.resume)
    if path.is_dir() and not is_sharded_folder(path):
        return _restore_from_folder(path, parts, job.skip_parts, world)
    restore_checkpoint(path, parts, job.skip_parts, world)
    return run.step.value


def prepare_run(job: TrainJob, store: CheckpointStore | None = None, world: World = World()) -> Run:
    """The run, built fresh as this rank's replica and restored as --resume says (config checked first)."""
    store = store or CheckpointStore(job.checkpoint_folder, keep=job.keep, notify=warn)
    run = build_run(job.config, load_tokens(job.data))
    replicate(run, world)
    run.identity.allowed = frozenset(ALLOWED_CHANGES[name] for name in job.allow_change)
    resume_run(job, run, store, world)
    return run


def _note_allowed_changes(run: Run, step: int) -> None:
    accepted = run.identity.accepted
    if not accepted:
        return
    saved = {name.removeprefix("train."): old for name, old, new in accepted}
    text = "; ".join(map(describe, accepted))
    if "steps" in saved or "lr" in saved:  # the schedule is lr_at(step, steps, lr): a new total reshapes it
        config = run.config
        before = lr_at(step, saved.get("steps", config.steps), saved.get("lr", config.lr))
        text += (
            f"; lr at step {step} was {before:.4g} on the old schedule, {lr_at(step, config.steps, config.lr):.4g} now"
        )
    note(f"resuming with allowed changes: {text}")


def _target(job: TrainJob, start: int) -> int:
    until = job.stop_at or job.config.steps
    # An auto-resumed run whose final checkpoint was already written only needs its outputs rewritten.
    if start > until or start == until and job.resume != AUTO_RESUME:
        raise UserError(f"the resume file is at step {start}; nothing to train up to step {until}")
    return until


def _write_outputs(job: TrainJob, run: Run, world: World) -> None:
    """The resume file or folder (every rank takes part), or the weights file (rank 0)."""
    path = job.resume_file if job.stop_at is not None else job.weights_file
    try:
        if job.stop_at is not None:
            save_checkpoint(path, per_rank(run.parts(), world), world, job.sharded)
        elif world.is_main:
            save_weights(path, run.model.state_dict())
    except OSError as error:
        raise storage_error(str(path), error, "; nothing half-written was left") from None


def _ignore(message: str) -> None:
    pass


def run_job(job: TrainJob, on_step=lambda record: None, on_start=lambda run: None, world: World = World()) -> Run:
    """Train as the job says and write its files; returns the finished run. Raises Preempted after saving.

    `on_start(run)` sees the run once, restored and about to step; `on_step(record)` after each step.
    Under many processes every rank calls this with its `world`; rank 0 writes the files.
    """
    _check_outputs(job)
    store = CheckpointStore(job.checkpoint_folder, keep=job.keep, notify=warn if world.is_main else _ignore)
    if world.is_main:
        _remove_leftovers(job, store)
    world.barrier()  # no rank reads the store while rank 0 clears it
    run = prepare_run(job, store, world)
    start = run.step.value
    if world.is_main:
        _note_allowed_changes(run, start)
    until = _target(job, start)
    on_start(run)
    with RunLogs(job, start, world) as logs:
        saver = Checkpointer(
            store,
            logs,
            saved_step=start if job.resume == AUTO_RESUME and start else None,
            world=world,
            background=job.async_save,
        )

        def after_step(record: StepRecord) -> None:
            logs.record(record)
            on_step(record)
            if job.save_every and run.step.value % job.save_every == 0:
                # Every step in the background means as often as the disk allows: a save asked for
                # while the one before is still being written is skipped, and counted.
                saver.save(run, coalesce=job.async_save and job.save_every == 1)
            # The ranks agree on a signal any of them caught, so all stop after the same step and save together.
            if world.any(guard.requested):
                raise Preempted(guard.signal_name or "a signal to another process", run.step.value)

        try:
            with PreemptionGuard() as guard:
                train(run, until, after_step)
        except Preempted as stop:
            stop.saved = saver.save(run)
            saver.wait()
            raise
        if job.save_every:
            saver.save(run)
            saver.wait()
            skipped = saver.background.coalesced if saver.background is not None else 0
            if skipped:
                note(f"{skipped} periodic checkpoint(s) skipped: the one before was still being written")
        _write_outputs(job, run, world)
    return run
