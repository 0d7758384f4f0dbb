"""Whether the state changed before a background save's copy was safe (a background store's
copy="during-next-step").

In that mode `save` returns before the state is copied: the copy runs while the loop goes on, and
the state must not change until the loop next waits for the copy (its optimizer's step, or
`wait_for_copy()`). A change made before then must refuse the save: written, the file could mix two
steps under one name. PyTorch counts each in-place operation on a tensor in its version counter
(`tensor._version`), which a state dict's tensors share with the parameters and buffers they are
detached from. The guard records every state tensor's count when `save` takes the state dicts and
compares them: after the copy of each tensor and after the whole copy (a change found there stops
the copy at once), and once more at the decision, which the loop's own thread makes when it waits
for the copy. There every operation it started has ended and been counted (an in-place operation is
counted when it ends, so the writer alone could miss one still running when the copy ends), and
whether a change refuses the save does not depend on how fast the copy was: a loop that changes the
state before its optimizer step is refused every time, not only when the copy happens to be slow.
The writer writes meanwhile, but publishes nothing until the decision (the rename of the file, the
completion of an object): a refused save leaves no file; if the loop's thread ends first, the writer
decides.

The counters miss what PyTorch does not count: writes through `.data` or a numpy view, and kernels
that update arguments uncounted, such as BatchNorm's running statistics (its forward counts
`num_batches_tracked` first, which the guard sees) and a fused optimizer's step (an optimizer among
the saved parts waits for the copy before its step).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from exactresume.errors import CheckpointError
from exactresume.store.resume import IMMUTABLE

LOOK_SECONDS = 0.1  # how often the writer, waiting for the decision, looks whether the loop's thread has ended


class CopyGuard:
    """The version counts of a state's tensors at `save`, and the one decision: did any change before
    the loop waited for the copy? Made in the loop's thread, which is the one whose changes count."""

    def __init__(self, step: int, state: Any):
        self.step, self.caller = step, threading.current_thread()
        self.tensors = list(_tensors(state, ()))  # (path, tensor, count) in the state's order
        self.counts = {id(tensor): count for _, tensor, count in self.tensors}
        self.copied = threading.Event()  # set when the copy has ended, made or not
        self.decided = threading.Event()
        self.changed: str | None = None  # the first tensor (in the state's order) found changed
        self.failed = False  # the copy itself raised
        self._lock = threading.Lock()

    def check_copied(self, tensor: torch.Tensor) -> None:
        """After the copy of `tensor`: refuse at once if it changed before or during it."""
        if _count(tensor) != self.counts[id(tensor)]:
            self.decide()
            raise self.error()

    def check_all(self) -> None:
        """After the whole copy: refuse at once if any tensor changed by now."""
        if self._first_changed() is not None:
            self.decide()
            raise self.error()

    def await_decision(self) -> None:
        """In the writer: wait for the loop's thread to decide, or decide once that thread has ended."""
        while not self.decided.wait(LOOK_SECONDS):
            if not self.caller.is_alive():
                self.decide()

    def confirm(self) -> None:
        """In the writer, before the file is published: wait for the decision; CheckpointError if refused."""
        self.await_decision()
        if self.changed is not None:
            raise self.error()

    def decide(self) -> None:
        """Compare every count now, once: the first to decide settles it (the loop's thread, or the writer
        when a change is found during the copy or the loop's thread has ended)."""
        with self._lock:
            if not self.decided.is_set():
                self.changed = self._first_changed()
                self.decided.set()

    def refuse(self) -> None:
        """The copy raised: nothing will be written, whatever the counts."""
        with self._lock:
            self.failed = True
            self.decided.set()

    def passed(self) -> bool:
        """Decided, and nothing changed: the file may be written and the state changed from now on."""
        return self.decided.is_set() and self.changed is None and not self.failed

    def error(self) -> CheckpointError:
        return CheckpointError(
            f"the checkpoint at step {self.step} was not written: {self.changed} changed in place before the "
            "loop waited for its copy (with copy='during-next-step' the state is copied during the next step "
            "and may change only from the optimizer's step on); save with the default copy='before-return', "
            "or make the change after store.wait_for_copy()"
        )

    def _first_changed(self) -> str | None:
        for path, tensor, count in self.tensors:
            if _count(tensor) != count:
                return ".".join(map(str, path))
        return None


def _tensors(value: Any, path: tuple):
    if isinstance(value, torch.Tensor):
        yield path, value, _count(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if type(item) not in IMMUTABLE:
                yield from _tensors(item, (*path, index))


def _count(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no count (and may not change outside inference mode)
        return None
