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

from collections.abc import Callable
from pathlib import Path

from exactresume.atomic import atomic_write_bytes
from exactresume.core.compare import weight_distance
from exactresume.core.steplog import DIVERGENCE_HEADER
from exactresume.training.loop import Run, StepRecord, train_step


class DivergenceLog:
    """A fully restored twin of the job's run, stepped alongside it; one distance row per step."""

    def __init__(self, path: Path, run: Run, build_reference: Callable[[], Run]):
        """`build_reference()` builds the twin: the same run restored with every part (it reseeds the globals)."""
        self.path, self.run, self.rows = Path(path), run, []
        run_rng = run.rng.state_dict()
        self.reference = build_reference()
        self.reference_rng = self.reference.rng.state_dict()
        run.rng.load_state_dict(run_rng)

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
        atomic_write_bytes(self.path, (DIVERGENCE_HEADER + "\n" + "".join(self.rows)).encode())
