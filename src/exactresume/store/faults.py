"""Fault injection for the save path: make a process die or fail at a named stage of a save.

The chaos test needs kills that land *inside* a save — halfway through the bytes, between the write
and the rename, between the rename and the folder fsync — which a timer hits only by luck. The
environment variable names one stage, optionally which save, and what happens there:

    EXACTRESUME_FAULT=rename          SIGKILL just before the 1st save's os.replace
    EXACTRESUME_FAULT=write@3         SIGKILL halfway through writing the 3rd save's bytes
    EXACTRESUME_FAULT=fsync:enospc    the 1st save's fsync raises OSError(ENOSPC)
    EXACTRESUME_FAULT=folder-fsync@2:eio
    EXACTRESUME_FAULT=retention@2:stop  SIGSTOP once the 2nd save is durable: frozen while it holds its lock

Only the checkpoint store reads it, once per store; nothing else in exactresume looks at it.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from exactresume.errors import UserError

FAULT_ENV = "EXACTRESUME_FAULT"
# The stages of CheckpointStore.save, in order (numbered.py, disk.py; atomic.atomic_write reports the middle four).
STAGES = ("snapshot", "write", "fsync", "rename", "folder-fsync", "verify", "retention")
# On an object store (s3/prefix.py): snapshot, write (the local copy), upload (each part), commit, retention.
OBJECT_STORE_STAGES = ("snapshot", "write", "upload", "commit", "retention")
ACTIONS = ("kill", "stop", "enospc", "eio")


@dataclass(frozen=True)
class Fault:
    """Do `action` when the save path reaches `stage` for the `nth` time in this process."""

    stage: str
    nth: int = 1
    action: str = "kill"

    def __post_init__(self) -> None:
        if self.stage not in STAGES + OBJECT_STORE_STAGES:
            known = ", ".join(dict.fromkeys(STAGES + OBJECT_STORE_STAGES))
            raise UserError(f"{FAULT_ENV}: unknown stage {self.stage!r}; stages are {known}")
        if self.action not in ACTIONS:
            raise UserError(f"{FAULT_ENV}: unknown action {self.action!r}; actions are {', '.join(ACTIONS)}")
        if self.nth < 1:
            raise UserError(f"{FAULT_ENV}: the save number after @ must be at least 1, got {self.nth}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """'STAGE[@N][:ACTION]' as a Fault."""
        where, _, action = text.partition(":")
        stage, _, nth = where.partition("@")
        try:
            return cls(stage.strip(), int(nth) if nth else 1, action.strip() or "kill")
        except ValueError:
            raise UserError(f"{FAULT_ENV}={text!r}: expected STAGE[@N][:ACTION], e.g. rename@2:kill") from None


class FaultPoints:
    """The save path calls `reached(stage)` at each stage; a planned fault fires there."""

    def __init__(self, fault: Fault | None = None):
        self.fault, self.hits = fault, 0

    @classmethod
    def from_environment(cls) -> FaultPoints:
        text = os.environ.get(FAULT_ENV, "").strip()
        return cls(Fault.parse(text) if text else None)

    def reached(self, stage: str) -> None:
        if self.fault is None or stage != self.fault.stage:
            return
        self.hits += 1
        if self.hits != self.fault.nth:
            return
        if self.fault.action in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if self.fault.action == "kill" else signal.SIGSTOP)
            return  # stopped, then continued (SIGCONT): the save goes on
        code = errno.ENOSPC if self.fault.action == "enospc" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_ENV})")
