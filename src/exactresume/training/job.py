"""One `exactresume train` invocation: what it reads and writes and how it checkpoints (TrainJob).

    outcome = JobRun(TrainJob(config, data, out, stop_at=30), world, progress).run()   # job_run.py

A job loads the prepared data, builds the run, optionally restores it (from a resume file, a
checkpoint folder, or with `--resume auto` from the newest valid checkpoint in --checkpoints),
trains to `--stop-at` or `--steps` while appending each step's log rows, saves a checkpoint every
`--save-every` steps and when preempted, and writes the resume file or the weights file at the end.
The job is checked when it is made, before torch is imported, so that a mistake is refused before
anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from exactresume.config import TrainConfig, check_keep, check_stop_at, check_wait_lock
from exactresume.errors import UserError
from exactresume.parallel.split import check_split
from exactresume.store.locations import Location, S3Location
from exactresume.training.outputs import named_as_a_checkpoint, within

# --resume auto (store.access.AUTO): the newest valid checkpoint in --checkpoints (default OUT/checkpoints),
# or a fresh start
AUTO_RESUME = "auto"
# --allow-change names -> the run-identity fields they let a resume change. Model shape and seed are
# not here: a different shape cannot load, and the seed only matters before step 1.
ALLOWED_CHANGES = {
    "steps": "train.steps",
    "lr": "train.lr",
    "batch": "train.batch",
    "seq-len": "train.seq_len",
    "data": "data",
}


def _identity(path: Path) -> object:
    """What tells two names of one file apart from two files: its inode where it exists, else its real path."""
    try:
        found = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (found.st_dev, found.st_ino)


@dataclass(frozen=True)
class TrainJob:
    """Where a training run reads and writes, how it checkpoints, and which parts a resume leaves out."""

    config: TrainConfig
    data: Path
    out: Path
    stop_at: int | None = None  # stop after this global step and write out/resume.pth
    resume: Location | str | None = None  # a resume file, a checkpoint folder (or s3:// of either), or AUTO_RESUME
    skip_parts: frozenset[str] = field(default_factory=frozenset)  # parts not restored (ablations)
    weights: Path | None = None  # default out/final.pth
    log: Path | None = None  # default out/log.csv
    samples: Path | None = None  # optional `step,starts` log of the windows each step trained on
    save_every: int | None = None  # also checkpoint to out/checkpoints every N steps and at the end
    keep: int | None = 3  # newest checkpoints kept in out/checkpoints; 0 or None keeps all (None once made)
    allow_change: frozenset[str] = field(default_factory=frozenset)  # keys of ALLOWED_CHANGES
    async_save: str | None = None  # periodic checkpoints written in the background, pickled in a thread or a process
    sharded: bool = False  # write the resume state as a DCP folder, out/resume.dcp, each rank its shard
    divergence: Path | None = None  # step a fully restored twin alongside; log the distance (divergence.py)
    wait_lock: float = 0.0  # seconds to wait for another writer of OUT to finish
    checkpoints: Location | None = None  # where the periodic checkpoints go (default out/checkpoints)
    local_checkpoints: Path | None = None  # a fast local tier every checkpoint lands in (store/tiers.py)
    durable_every: int | None = None  # with a local tier: the steps copied to `checkpoints`
    processes: int = 1  # the processes the run trains on: --nproc, or under torchrun its world size
    force: bool = False  # start even when the plan says the run will not fit its memory or disk
    overwrite: bool = False  # a fresh run may replace an earlier run's outputs (earlier_outputs)
    dry_run: bool = False  # print the plan and train nothing

    def __post_init__(self) -> None:
        if self.stop_at is not None:
            check_stop_at(self.stop_at, self.config.steps)
        if self.skip_parts and self.resume is None:
            raise UserError("--no-optim and --no-skip only make sense with --resume")
        if self.save_every is not None and self.save_every < 1:
            raise UserError(f"--save-every must be at least 1, got {self.save_every}")
        if self.async_save and self.save_every is None:
            raise UserError("--async-save needs --save-every N: it changes how the periodic checkpoints are written")
        object.__setattr__(self, "keep", check_keep(self.keep))
        check_split(self.config.batch, self.processes, self.config.grad_accum, self.config.micro_batch)
        unknown = sorted(set(self.allow_change) - set(ALLOWED_CHANGES))
        if unknown:
            raise UserError(f"--allow-change {unknown[0]}: only {', '.join(ALLOWED_CHANGES)} may change on resume")
        if self.sharded and self.stop_at is None:
            raise UserError("--sharded only makes sense with --stop-at (it is how the resume state is written)")
        if self.async_save and self.config.fsdp:
            # Every rank writes its shard of each checkpoint: rank 0's writer thread cannot do it alone.
            raise UserError("--async-save does not combine with --shard fsdp: its checkpoints are saved synchronously")
        self._check_waiting()
        self._check_tiers()
        if self.divergence is not None and self.resume is None:
            raise UserError("--divergence measures a resumed run against a full restore; it needs --resume")
        if self.divergence is not None and self.config.fsdp:  # the twin is one whole model on rank 0
            raise UserError("--divergence does not combine with --shard fsdp")
        if self.overwrite and self.resume is not None:
            raise UserError("--overwrite is for a run that starts fresh: a resumed run continues its own outputs")
        self._check_outputs_apart()

    def _check_outputs_apart(self) -> None:
        if _identity(self.out) == _identity(self.data):
            raise UserError(f"--out {self.out} is the --data folder: give the run a folder of its own")
        if within(self.out, self.data):
            raise UserError(f"--out {self.out} is in the --data folder {self.data}: give the run a folder of its own")
        folders = self.checkpoint_folders()
        for flag, folder in folders.items():  # the corpus's folder holds the corpus alone
            if within(folder, self.data):
                raise UserError(f"{flag} {folder} is in the --data folder {self.data}: give it a folder of its own")
        seen: dict[str, str] = {}
        for flag, path in self.outputs().items():
            other = seen.setdefault(_identity(path), flag)  # a link to another output, soft or hard, is that output
            if other != flag:
                raise UserError(f"{other} and {flag} name the same file, {path}: give each a file of its own")
            holder = next((name for name, folder in folders.items() if _identity(folder) == _identity(path)), None)
            if holder is not None:
                raise UserError(f"{flag} {path} is the {holder} folder: give the file a place of its own")
            if named_as_a_checkpoint(path):
                raise UserError(f"{flag} {path} is named as a store names its checkpoints: give the file another name")
            if within(path, self.data):
                raise UserError(f"{flag} {path} is in the --data folder {self.data}: give the file another place")

    def checkpoint_folders(self) -> dict[str, Path]:
        """The local folders of the run's checkpoints, by the flag that names them (OUT/checkpoints by default)."""
        named = {"--checkpoints": self.checkpoint_folder, "--local-checkpoints": self.local_checkpoints}
        return {flag: folder for flag, folder in named.items() if isinstance(folder, Path)}

    def outputs(self) -> dict[str, Path]:
        """The local files the run writes, by the flag that names them."""
        ending = (
            ("--stop-at's resume file", self.resume_file)
            if self.stop_at is not None
            else ("--weights", self.weights_file)
        )
        named = dict([ending, ("--log", self.log_file), ("--samples", self.samples), ("--divergence", self.divergence)])
        return {flag: path for flag, path in named.items() if isinstance(path, Path)}

    def _check_tiers(self) -> None:
        if (self.local_checkpoints is None) != (self.durable_every is None):
            raise UserError("--local-checkpoints and --durable-every N go together: the local tier, and its steps kept")
        if self.local_checkpoints is None:
            return
        if self.save_every is None:
            raise UserError("--local-checkpoints needs --save-every N: it is where those checkpoints land")
        taken = [self.out] + ([self.checkpoint_folder] if isinstance(self.checkpoint_folder, Path) else [])
        if os.path.abspath(self.local_checkpoints) in map(os.path.abspath, taken):
            raise UserError(
                f"--local-checkpoints {self.local_checkpoints} is OUT or --checkpoints: give it a folder of its own"
            )
        if self.durable_every < 1:
            raise UserError(f"--durable-every must be at least 1, got {self.durable_every}")
        if self.config.fsdp:  # each node would hold only its own ranks' shards
            raise UserError("--local-checkpoints does not combine with --shard fsdp: its checkpoints are sharded")
        if self.divergence is not None:  # the twin restores on rank 0 alone, where the tiers are chosen by all
            raise UserError("--divergence does not combine with --local-checkpoints")

    def _check_waiting(self) -> None:
        check_wait_lock(self.wait_lock)
        if self.wait_lock and self.resume != AUTO_RESUME:
            # Waiting is for a requeued job: it must continue from what the other left, not start over its log.
            raise UserError(
                "--wait-lock needs --resume auto: after the wait the run continues from the newest checkpoint"
            )

    @property
    def writes_sharded(self) -> bool:
        """The resume state goes to a DCP folder: asked for, or the only way an FSDP2 run's shards are kept."""
        return self.sharded or self.config.fsdp

    @property
    def resume_file(self) -> Location:
        """OUT/resume.pth (or .dcp); beside the checkpoints when they are on an object store."""
        name = "resume.dcp" if self.writes_sharded else "resume.pth"
        return self.checkpoint_folder / name if isinstance(self.checkpoint_folder, S3Location) else self.out / name

    @property
    def checkpoint_folder(self) -> Location:
        return self.checkpoints if self.checkpoints is not None else self.out / "checkpoints"

    @property
    def weights_file(self) -> Path:
        return self.weights or self.out / "final.pth"

    @property
    def log_file(self) -> Path:
        return self.log or self.out / "log.csv"

    def earlier_outputs(self) -> list[Path]:
        """The files a fresh start would write that are already there: an earlier run's, which it would
        overwrite (a resumed run continues its own)."""
        if self.resume is not None or self.overwrite:
            return []
        return [path for path in self.outputs().values() if os.path.lexists(path)]

    @property
    def until(self) -> int:
        """The global step the job trains to."""
        return self.stop_at or self.config.steps
