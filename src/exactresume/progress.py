"""Progress of long work: a redrawn bar on a terminal, plain periodic lines in logs, or nothing.

    progress = Progress(total=60, label="train", mode=resolve_mode("auto"))
    progress.begin(0)
    progress.update(12, loss=6.23)   # step 12/60, loss, steps/s
    progress.close()

`auto` draws a bar when the stream is a terminal and writes plain lines otherwise (CI, log files,
a parent process reading a pipe): the first step, then at most one line per `interval` seconds,
then the last step. `none` (the CLI's `--quiet`) writes nothing.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

MODES = ("auto", "bar", "lines", "none")
BAR_WIDTH = 24
LINE_INTERVAL = 10.0  # seconds between plain lines: a line per step would flood a CI log
BAR_INTERVAL = 0.1  # seconds between redraws: fast steps would spend their time drawing


def resolve_mode(requested: str, stream: TextIO | None = None) -> str:
    """`bar`, `lines` or `none`; `auto` is `bar` on a terminal and `lines` anywhere else."""
    if requested != "auto":
        return requested
    stream = stream or sys.stdout
    return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"


class Progress:
    """One long task counted in `unit`s up to `total`, shown as `mode` says."""

    def __init__(
        self,
        total: int,
        label: str,
        mode: str,
        unit: str = "step",
        stream: TextIO | None = None,
        interval: float = LINE_INTERVAL,
    ):
        self.total, self.label, self.mode, self.unit = total, label, mode, unit
        self.stream = stream or sys.stdout
        self.interval = interval
        self.first, self.started, self.last_written = 0, time.perf_counter(), None
        self.done, self.fields, self.drawn = 0, {}, False

    def begin(self, done: int = 0) -> None:
        """Start the clock at `done` units (a resumed run begins part way)."""
        self.first = self.done = done
        self.started = time.perf_counter()

    def rate(self) -> float | None:
        seconds = time.perf_counter() - self.started
        return (self.done - self.first) / seconds if self.done > self.first and seconds > 0 else None

    def update(self, done: int, **fields: float) -> None:
        """`done` units finished; `fields` (e.g. loss=6.2) are shown beside the count."""
        self.done, self.fields = done, fields
        if self.mode == "none":
            return
        now = time.perf_counter()
        interval = BAR_INTERVAL if self.mode == "bar" else self.interval
        if self.last_written is not None and now - self.last_written < interval and done < self.total:
            return
        self.last_written = now
        if self.mode == "bar":
            self._draw_bar()
        else:
            self._write(self._status() + "\n")

    def close(self) -> None:
        """End the bar's line so what follows starts on a fresh one."""
        if self.mode == "bar" and self.drawn:
            self._write("\n")
            self.drawn = False

    def _status(self) -> str:
        parts = [f"{self.label}: {self.unit} {self.done}/{self.total}"]
        parts += [f"{name} {value:.4f}" for name, value in self.fields.items()]
        rate = self.rate()
        units = self.unit if self.unit.endswith("B") else self.unit + "s"  # MB/s, steps/s
        parts.append(f"{rate:.2f} {units}/s" if rate is not None else f"- {units}/s")
        return " ".join(parts)

    def _draw_bar(self) -> None:
        filled = round(BAR_WIDTH * min(self.done / self.total, 1.0)) if self.total else BAR_WIDTH
        bar = "█" * filled + "·" * (BAR_WIDTH - filled)
        label, _, rest = self._status().partition(": ")
        line = f"{label} |{bar}| {rest}"
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self._write("\r" + line[:width].ljust(width))
        self.drawn = True

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


class ByteProgress:
    """A `(bytes done, bytes in all)` progress callback shown in MB. Its clock starts at the first call: a
    call at 0 bytes, as the work begins, only starts it (else a first call at the end would show the work's
    rate over no time at all)."""

    def __init__(self, label: str, mode: str, stream: TextIO | None = None):
        self.label, self.mode, self.stream = label, mode, stream
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None and self.bar.done >= self.bar.total:  # said once (reading runs ahead of the work)
            return
        if self.bar is None:
            self.bar = Progress(max(1, round(total / 1e6)), self.label, self.mode, unit="MB", stream=self.stream)
            if done == 0:
                return
        self.bar.update(self.bar.total if done >= total else min(round(done / 1e6), self.bar.total))
        if done >= total:
            self.bar.close()
