"""One `exactresume train` invocation: a run plus its files.

Loads the prepared data, builds the run, optionally restores it (from a resume file, a checkpoint
folder, or with `--resume auto` from the newest valid checkpoint in OUT/checkpoints), trains to
`--stop-at` or `--steps` while appending each step's log rows, saves a checkpoint every
`--save-every` steps and when preempted, and writes the resume file or the weights file at the end.

The source is opened by the store's one way in (store/access.py `open_resume`); the saves go out
through its one save interface (saving.py); the logs and the job's lines are joblog.py's. Under many
processes (dist/) every rank runs the job: every rank builds and restores its replica and takes
part in each save (the per-rank parts are gathered from all), only rank 0 writes the files and the
logs; with `sharded` (always under `--shard fsdp`) every rank writes its shard of OUT/resume.dcp.

Exit paths: done (0); a user's mistake (UserError, 2); a disk that refuses a write (StorageError,
74: the previous checkpoint is intact and nothing half-written is left); SIGTERM/SIGINT (Preempted,
75: a checkpoint of the finished step is saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from exactresume.atomic import ensure_writable_folder, tmp_path
from exactresume.config import TrainConfig, check_stop_at
from exactresume.core.data import load_tokens
from exactresume.errors import UserError
from exactresume.parallel.fsdp import full_parts, shard_destinations
from exactresume.parallel.replicate import replicate
from exactresume.store.access import AUTO, open_resume
from exactresume.store.folder import CheckpointStore
from exactresume.store.resume import per_rank
from exactresume.training.joblog import RunLogs, ignore, note, warn
from exactresume.training.loop import Run, StepRecord, build_run, lr_at, train
from exactresume.training.parts import describe
from exactresume.training.preemption import Preempted, PreemptionGuard
from exactresume.training.saving import Checkpointer, write_outputs
from exactresume.world import World

AUTO_RESUME = AUTO  # --resume auto: the newest valid checkpoint in OUT/checkpoints, or a fresh start
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
        if self.async_save and self.config.shard == "fsdp":
            # Gathering a sharded model is a collective: it cannot run in rank 0's writer thread alone.
            raise UserError("--async-save does not combine with --shard fsdp: its checkpoints are saved synchronously")

    @property
    def writes_sharded(self) -> bool:
        """The resume state goes to a DCP folder: asked for, or the only way an FSDP2 run's shards are kept."""
        return self.sharded or self.config.shard == "fsdp"

    @property
    def resume_file(self) -> Path:
        return self.out / ("resume.dcp" if self.writes_sharded else "resume.pth")

    @property
    def checkpoint_folder(self) -> Path:
        return self.out / "checkpoints"

    @property
    def weights_file(self) -> Path:
        return self.weights or self.out / "final.pth"

    @property
    def log_file(self) -> Path:
        return self.log or self.out / "log.csv"


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


def resume_run(job: TrainJob, run: Run, world: World = World()) -> int:
    """Restore the run as --resume says (config checked first); the step it continues from.

    Every rank restores its replica, through the per-rank parts (each rank's entry of them). The
    source is opened by the store's one way in: a resume file, a sharded folder, a checkpoint folder
    or, with --resume auto, the newest valid checkpoint in OUT/checkpoints.
    """
    if job.resume is None:
        return 0
    needs = [name for name in run.parts() if name not in job.skip_parts]
    notify = warn if world.is_main else ignore
    # A sharded folder is read straight into this rank's shards; a single file holds the full state.
    into = shard_destinations(run.model)
    resumed = open_resume(job.resume, job.checkpoint_folder, needs, notify=notify, destination=into)
    if resumed is None:
        if world.is_main:
            note(f"no checkpoint in {job.checkpoint_folder}; starting at step 0")
        return 0
    fsdp = run.config.shard == "fsdp"
    parts = run.parts() if resumed.kind == "sharded" else full_parts(run.parts(), fsdp)
    resumed.restore(per_rank(parts, world), skip=job.skip_parts)
    change = resumed.world_change(world)
    if world.is_main and resumed.kind == "store":
        note(f"resumed from {resumed.path} at step {resumed.step}")
    if world.is_main and change:
        print(change)
    return run.step.value


def prepare_run(job: TrainJob, world: World = World()) -> Run:
    """The run, built fresh as this rank's replica and restored as --resume says (config checked first)."""
    run = build_run(job.config, load_tokens(job.data))
    replicate(run, world)
    run.identity.allowed = frozenset(ALLOWED_CHANGES[name] for name in job.allow_change)
    resume_run(job, run, world)
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


def run_job(job: TrainJob, on_step=lambda record: None, on_start=lambda run: None, world: World = World()) -> Run:
    """Train as the job says and write its files; returns the finished run. Raises Preempted after saving.

    `on_start(run)` sees the run once, restored and about to step; `on_step(record)` after each step.
    Under many processes every rank calls this with its `world`; rank 0 writes the files.
    """
    _check_outputs(job)
    # The store locks OUT/checkpoints from its first write (rank 0 only) until the run ends.
    with CheckpointStore(job.checkpoint_folder, keep=job.keep, notify=warn if world.is_main else ignore) as store:
        return _run_with_store(job, store, on_step, on_start, world)


def _run_with_store(job: TrainJob, store: CheckpointStore, on_step, on_start, world: World) -> Run:
    if world.is_main:
        _remove_leftovers(job, store)
    world.barrier()  # no rank reads the store while rank 0 clears it
    run = prepare_run(job, world)
    start = run.step.value
    if world.is_main:
        _note_allowed_changes(run, start)
    until = _target(job, start)
    on_start(run)
    with RunLogs(job.log_file, job.samples, start, world) as logs:
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
            if saver.coalesced and world.is_main:
                note(f"{saver.coalesced} periodic checkpoint(s) skipped: the one before was still being written")
        resume_file = job.resume_file if job.stop_at is not None else None
        write_outputs(run, resume_file, job.weights_file, job.writes_sharded, world)
    return run
