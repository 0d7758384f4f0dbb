"""One `exactresume train` invocation: a run plus its files.

Loads the prepared data, builds the run, optionally restores a resume file (leaving parts out
for the lab's ablations), trains to `--stop-at` or `--steps`, and writes the resume file or the
weights file and the logs, each atomically. Under many processes (distributed.py) every rank runs
the job; only rank 0 writes files, and with `sharded` every rank writes its shard of the resume state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_write_bytes, ensure_writable_folder
from .config import TrainConfig
from .data import load_tokens
from .distributed import World, restore_checkpoint, save_checkpoint
from .errors import UserError
from .train import Run, StepRecord, build_run, train
from .weights import save_weights


@dataclass(frozen=True)
class TrainJob:
    """Where a training run reads and writes, and which parts a resume leaves out."""

    config: TrainConfig
    data: Path
    out: Path
    stop_at: int | None = None  # stop after this global step and write out/resume.pth
    resume: Path | None = None  # continue from this resume file
    skip_parts: frozenset[str] = field(default_factory=frozenset)  # parts not restored (ablations)
    weights: Path | None = None  # default out/final.pth
    log: Path | None = None  # default out/log.csv
    samples: Path | None = None  # optional `step,starts` log of the windows each step trained on
    sharded: bool = False  # write the resume state as a DCP folder, out/resume.dcp, each rank its shard

    def __post_init__(self) -> None:
        if self.stop_at is not None and not 1 <= self.stop_at < self.config.steps:
            raise UserError(f"--stop-at {self.stop_at} must be between 1 and --steps - 1 ({self.config.steps - 1})")
        if self.skip_parts and self.resume is None:
            raise UserError("--no-optim and --no-skip only make sense with --resume")
        if self.sharded and self.stop_at is None:
            raise UserError("--sharded only makes sense with --stop-at (it is how the resume state is written)")

    @property
    def resume_file(self) -> Path:
        return self.out / ("resume.dcp" if self.sharded else "resume.pth")


class RunLogs:
    """The rows this process trains, kept in memory and written atomically when the run ends."""

    def __init__(self):
        self.losses, self.samples = io.StringIO("step,train_loss\n"), io.StringIO("step,starts\n")
        self.losses.seek(0, io.SEEK_END)
        self.samples.seek(0, io.SEEK_END)

    def record(self, record: StepRecord) -> None:
        self.losses.write(f"{record.step},{record.loss:.6f}\n")
        self.samples.write(f"{record.step},{' '.join(str(int(s)) for s in record.starts)}\n")


def prepare_run(job: TrainJob, world: World = World()) -> Run:
    """The run, built fresh as this rank's replica and, with --resume, restored (config checked first)."""
    run = build_run(job.config, load_tokens(job.data))
    world.replicate(run)
    if job.resume is not None:
        restore_checkpoint(job.resume, world.parts(run.parts()), job.skip_parts, world)
    return run


def _check_outputs(job: TrainJob) -> None:
    for path in (job.out, (job.weights or job.out).parent, (job.log or job.out).parent):
        ensure_writable_folder(path)
    if job.resume is not None and job.stop_at is None and (job.weights or job.out / "final.pth") == job.resume:
        raise UserError(f"--weights would overwrite the resume file {job.resume}")


def run_job(job: TrainJob, on_step=lambda record: None, world: World = World()) -> Run:
    """Train as the job says and write its files (rank 0); returns the finished run."""
    _check_outputs(job)
    run = prepare_run(job, world)
    until = job.stop_at or job.config.steps
    if run.step.value >= until:
        raise UserError(f"the resume file is at step {run.step.value}; nothing to train up to step {until}")
    logs = RunLogs()
    train(run, until, lambda record: (logs.record(record), on_step(record)))
    if world.is_main:
        atomic_write_bytes(job.log or job.out / "log.csv", logs.losses.getvalue().encode())
        if job.samples:
            atomic_write_bytes(job.samples, logs.samples.getvalue().encode())
    if job.stop_at is not None:
        save_checkpoint(job.resume_file, world.parts(run.parts()), world, job.sharded)
    elif world.is_main:
        save_weights(job.weights or job.out / "final.pth", run.model.state_dict())
    return run
