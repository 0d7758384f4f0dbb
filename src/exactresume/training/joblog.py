"""What a training job says besides its checkpoints: its lines on stdout and stderr, the one-line
StorageError for a disk that refuses a write, and the per-step loss and samples logs (RunLogs).
"""

from __future__ import annotations

import contextlib
import sys

from exactresume.core.steplog import LOSS_HEADER, SAMPLES_HEADER, StepLog
from exactresume.errors import StorageError
from exactresume.training.loop import StepRecord
from exactresume.world import World


def note(message: str) -> None:
    """A line on stdout about what the job did (where it resumed from)."""
    print(f"exactresume train: {message}", flush=True)


def warn(message: str) -> None:
    """A line on stderr about something the user should know (a damaged checkpoint skipped)."""
    print(f"exactresume train: {message}", file=sys.stderr, flush=True)


def ignore(message: str) -> None:
    """What a rank other than 0 does with a note or a warning: rank 0 says it once."""


class RunLogs:
    """This process's loss log and optional samples log, trimmed to the resumed step, one row per step."""

    def __init__(self, log_file, samples_file, resumed_step: int, world: World = World()):
        self.logs: list[StepLog] = []
        if not world.is_main:  # rank 0 logs the global batch and the loss averaged over ranks
            return
        # Both files are checked before either is touched: a refusal changes nothing.
        self.logs = [StepLog(log_file, LOSS_HEADER, resumed_step)]
        if samples_file:
            self.logs.append(StepLog(samples_file, SAMPLES_HEADER, resumed_step))

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
            line = "; training stopped (rerun with --resume auto)"
            raise StorageError.from_os_error(f"the log {log.path}", error, line) from None
