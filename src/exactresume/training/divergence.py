"""How far a resumed run drifts from the uninterrupted one, measured after every step.

`exactresume train --resume R --no-optim --divergence FILE` builds a second, *reference* run in the
same process, restored from R with every part, and steps it alongside the ablated run. After each
step it writes `step,max_abs_diff,rel_l2,loss,reference_loss`: the distance between the two runs'
weights (compare.weight_distance, the measure the lab reports for the final files) and both losses.
The reference is the uninterrupted run itself: a full restore continues it bit for bit, and its
`reference_loss` column equals the straight run's log row for row.

The two runs share the process's global RNGs (dropout, any other draw), so each steps with its own
saved RNG state swapped in. Without the flag none of this exists: the default path pays nothing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exactresume.atomic import atomic_write_bytes, ensure_writable_folder
from exactresume.core.compare import weight_distance
from exactresume.errors import UserError
from exactresume.training.job import TrainJob, prepare_run
from exactresume.training.loop import Run, StepRecord, train_step

HEADER = "step,max_abs_diff,rel_l2,loss,reference_loss\n"


class DivergenceLog:
    """A fully restored twin of the job's run, stepped alongside it; one distance row per step."""

    def __init__(self, job: TrainJob, path: Path):
        if job.resume is None:
            raise UserError("--divergence measures a resumed run against a full restore; it needs --resume")
        if job.config.shard == "fsdp":  # the twin is one whole model on rank 0; the run's weights are shards
            raise UserError("--divergence does not combine with --shard fsdp")
        ensure_writable_folder(Path(path).parent)  # refuse before training, not after
        self.job, self.path = job, Path(path)
        self.run: Run | None = None
        self.reference: Run | None = None
        self.reference_rng: dict | None = None
        self.rows: list[str] = []

    def attach(self, run: Run) -> None:
        """Build the reference for `run` (call once, after `run` is restored, before it steps)."""
        run_rng = run.rng.state_dict()
        self.reference = prepare_run(replace(self.job, skip_parts=frozenset()))  # reseeds the globals
        self.reference_rng = self.reference.rng.state_dict()
        run.rng.load_state_dict(run_rng)
        self.run = run

    def record(self, record: StepRecord) -> None:
        """Step the reference once (the run just stepped) and log the distance between the two."""
        run_rng = self.run.rng.state_dict()
        self.reference.rng.load_state_dict(self.reference_rng)
        reference_record = train_step(self.reference)
        self.reference_rng = self.reference.rng.state_dict()
        self.run.rng.load_state_dict(run_rng)
        distance = weight_distance(self.run.model.state_dict(), self.reference.model.state_dict())
        # repr keeps every bit of the floats, so the last row can be checked against the final files.
        self.rows.append(
            f"{record.step},{distance['max_abs_diff']!r},{distance['rel_l2']!r},"
            f"{record.loss:.6f},{reference_record.loss:.6f}\n"
        )

    def write(self) -> None:
        atomic_write_bytes(self.path, (HEADER + "".join(self.rows)).encode())
