"""Per-step CSV logs (step,train_loss, step,starts and the divergence log): written so they survive
crashes and resumes, and read back for comparisons and figures.

One rule: a log file that already exists keeps its rows up to the step the run resumes from and
loses the rest, then the new rows are appended; a new file holds only the rows this process trains
(the lab's resumed_log.csv). So after any sequence of kills and `--resume auto` restarts into one
folder, the log equals an uninterrupted run's byte for byte. Each row reaches the OS when its step
ends (a kill -9 loses nothing already stepped) and the file is fsynced before every checkpoint, so a
durable checkpoint always has its rows on disk. A half-written last row (a power cut) is dropped.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import BinaryIO

from exactresume.atomic import fsync_path
from exactresume.errors import UserError

LOSS_HEADER = "step,train_loss"
SAMPLES_HEADER = "step,starts"
DIVERGENCE_HEADER = "step,max_abs_diff,rel_l2,loss,reference_loss"  # training/divergence.py writes it


class StepLog:
    """`StepLog(path, header, resumed_step)` checks the file (writing nothing); `open()` trims it and appends."""

    def __init__(self, path: Path, header: str, resumed_step: int):
        self.path, self.header = Path(path), header
        self.keep_bytes = _kept_length(self.path, header, resumed_step)  # None: no file yet
        self.file: BinaryIO | None = None

    def open(self) -> StepLog:
        """Drop the rows after the resumed step (or create the file with its header), then open for appending."""
        if self.keep_bytes is None or self.keep_bytes == 0:
            with open(self.path, "wb") as file:
                file.write(f"{self.header}\n".encode())
            fsync_path(self.path.parent)
        else:
            os.truncate(self.path, self.keep_bytes)
        self.file = open(self.path, "ab")
        return self

    def append(self, step: int, values: str) -> None:
        """One row, handed to the OS at once: a kill after this line returns cannot lose it."""
        self.file.write(f"{step},{values}\n".encode())
        self.file.flush()

    def sync(self) -> None:
        """Make every row written so far durable (before a checkpoint that depends on them)."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.sync()
            self.file.close()
            self.file = None


def _kept_length(path: Path, header: str, resumed_step: int) -> int | None:
    """Bytes of `path` to keep: header plus complete rows with step <= `resumed_step`; None if no file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise UserError(f"log path {path} is a folder") from None
    except OSError as error:
        raise UserError(f"cannot read the log {path}: {error.strerror}") from None
    first = header.encode() + b"\n"
    if not data.startswith(first):
        if first.startswith(data):  # empty, or a header cut short by a crash
            return 0
        raise UserError(f"{path} exists and is not a {header} log; refusing to overwrite it (choose another path)")
    keep = len(first)
    for line in data[keep:].split(b"\n")[:-1]:  # the last piece has no newline: absent or half-written
        step = _row_step(line)
        if step is None or step > resumed_step:
            break
        keep += len(line) + 1
    return keep


def _row_step(line: bytes) -> int | None:
    try:
        return int(line.split(b",", 1)[0])
    except ValueError:
        return None


def read_loss_log(path: Path) -> dict[int, str]:
    """A `step,train_loss` log as {step: loss text}, the text exactly as written."""
    with open(path, newline="") as file:
        return {int(row["step"]): row["train_loss"] for row in csv.DictReader(file)}


def read_samples(path: Path) -> dict[int, list[int]]:
    """A `step,starts` samples log as {step: window offsets}."""
    with open(path, newline="") as file:
        return {int(row["step"]): [int(s) for s in row["starts"].split()] for row in csv.DictReader(file)}


def read_divergence(path: Path) -> list[dict]:
    """A divergence log as rows {step, max_abs_diff, rel_l2, loss, reference_loss (text)}."""
    lines = Path(path).read_text().splitlines()[1:]
    rows = []
    for line in lines:
        step, max_abs, rel_l2, loss, reference_loss = line.split(",")
        rows.append(
            {
                "step": int(step),
                "max_abs_diff": float(max_abs),
                "rel_l2": float(rel_l2),
                "loss": loss,
                "reference_loss": reference_loss,
            }
        )
    return rows
