"""Preemption: SIGTERM or SIGINT asks a training loop to finish its step, save, and exit.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before they kill a job;
a user presses Ctrl-C (SIGINT). While a `PreemptionGuard` is active the first such signal only
sets a flag; the loop checks it after every step, writes a resume file and exits with
`PREEMPTED_EXIT`. A second signal is not caught: SIGTERM kills at once, SIGINT raises
KeyboardInterrupt (exit 130, no save), for a user who does not want to wait.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

# sysexits.h EX_TEMPFAIL, "temporary failure, the user is invited to retry": the resume file is
# written and `--resume auto` continues. Distinct from 0 (done), 2 (bad input), 74 (disk error).
PREEMPTED_EXIT = 75
CAUGHT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Raised after a step completes when a preemption signal has arrived; `saved` is set once saved."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(signal_name, step)
        self.signal_name, self.step = signal_name, step
        self.saved: Path | None = None

    def __str__(self) -> str:
        where = f"; saved {self.saved}, continue with --resume auto" if self.saved else ""
        return f"stopped by {self.signal_name} after step {self.step}{where}"


class PreemptionGuard:
    """`with PreemptionGuard() as guard:` ... after each step, `guard.requested` says whether to stop and save."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals only there
            self._previous = {number: signal.signal(number, self._handle) for number in CAUGHT_SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(number).name
        self._uninstall()  # the next signal takes its usual, immediate effect

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
