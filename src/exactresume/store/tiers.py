"""Two tiers of checkpoints: every save to a fast local folder, every N-th step copied to durable storage.

    store = CheckpointStore("s3://bucket/run", local="/dev/shm/run", durable_every=50)
    store.save(step, parts)   # /dev/shm/run/step-….pth at every call; s3://bucket/run/ one of every 50 steps

A save lands in the local tier as any save does (written, verified, the newest `keep` kept). The first
checkpoint of each stretch of `durable_every` steps (steps k·N to (k+1)·N - 1: the multiple itself when
it is saved, else the next one saved, where saves skip it or are not that frequent) is then copied to
the durable tier from the local file's verified bytes, in a thread of its own, never serialised twice:
the loop goes on while it uploads. The file is opened when it is handed over, so the local tier's
pruning cannot take it from under the copy. At most one copy is in flight; a step due while the one
before is still being copied is left to the local tier (counted in `skipped`) and the next checkpoint
of its stretch is copied instead, so a slow durable tier costs durable checkpoints, never training
time. At `close` the newest local checkpoint, due or not, is copied if the durable tier does not hold
its step yet: a run that ends (or is preempted and saves) leaves its last step durable; a script that
leaves its store open has it done at the interpreter's exit.
A copy that fails is raised by the store's next `save`, `wait` or `close`, as the store's one line
for a write the storage refused.

A resume takes the newest checkpoint that verifies and is this run's (its identity) across both
tiers: a local tier lost with its node, wiped, damaged or holding another run's checkpoint falls back
to the durable tier. Under many processes, where each node has its own local tier, every rank takes
the same step or all take the durable tier's newest (numbered.py).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import BinaryIO

from exactresume.errors import FieldError, StorageError, tell_unraised
from exactresume.store.layout import Layout
from exactresume.store.locations import Checkpoint
from exactresume.store.place import Place
from exactresume.store.seal_hash import thread_in_this_context

_UNFINISHED: weakref.WeakSet[DurableCopy] = weakref.WeakSet()  # tiers whose newest step may not be durable yet


@atexit.register
def _finish_at_exit() -> None:
    """At the interpreter's exit (after its threads ended), what `close` would have done for a store a
    script left open: its newest local step copied durable; what fails is said, as nothing is left to raise it."""
    for copier in list(_UNFINISHED):
        try:
            copier.finish()
        except Exception as failure:
            tell_unraised(failure)


class DurableCopy:
    """The copier of local checkpoints to the durable tier, one at a time, in a thread."""

    def __init__(
        self,
        durable: Place,
        layout: Layout,
        every: int,
        retain: Callable[[int], None],
        refused: Callable[[int, OSError], StorageError],
    ):
        """`retain(step)` prunes the durable tier once the copy at `step` is in; `refused(step, error)` is
        the store's line for a write the storage refused."""
        self.durable, self.layout, self.every = durable, layout, _check_every(every)
        self.retain, self.refused = retain, refused
        self.skipped = 0  # steps due while the copy before was in flight: left to the local tier
        self.newest: Checkpoint | None = None  # the newest local checkpoint written, and the newest copied
        self.copied: int | None = None
        self.handed: int | None = None  # the step of the last checkpoint whose copy was started
        self.told_at: int | None = None  # the newest local step when a failed copy was last raised
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def landed(self, local: Checkpoint) -> None:
        """A checkpoint was written to the local tier; copied now if its step is due (`copy`)."""
        if self.newest is None or local.step >= self.newest.step:
            self.newest = local
        _UNFINISHED.add(self)
        if self.due(local.step):
            self.copy(local)

    def due(self, step: int) -> bool:
        """Whether the checkpoint at `step` is the first of its stretch of `every` steps to land (one
        copied per stretch, whichever steps are saved)."""
        stretch = step // self.every
        return stretch >= 1 and (self.handed is None or stretch > self.handed // self.every)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def copy(self, local: Checkpoint) -> None:
        """Start copying the verified local checkpoint `local` to the durable tier (or count it skipped); then
        raise the failure of the copy before, if it failed (this one is tried all the same, unless the durable
        tier stopped answering: then the next due step is, and a run that stops here does not wait on it)."""
        failure, self._failure = self._failure, None
        if self.busy():
            self.skipped += 1
        elif failure is None or not self.durable.gave_up():
            source = open(local.path, "rb")  # held open: the local tier's pruning may unlink the name
            target = Checkpoint(local.step, self.durable.folder / self.layout.name(local.step))
            self.handed = local.step
            # Not a daemon: an exiting interpreter lets a started copy finish rather than cut it off.
            self._thread = thread_in_this_context(self._copy, (target, source), f"durable-{local.step}")
            self._thread.start()
        if failure is not None:
            self.told_at = local.step
            raise failure

    def _copy(self, target: Checkpoint, source: BinaryIO) -> None:
        try:
            with source:
                self.durable.prepare(target, self.layout)
                self.durable.write_copy(target, source)
            self.copied = target.step if self.copied is None else max(self.copied, target.step)
            self.retain(target.step)
        except OSError as error:
            self._failure = self.refused(target.step, error)
        except BaseException as error:  # a UserError (a lease lost) as it is; anything else is a bug
            self._failure = error

    def finish(self) -> None:
        """Wait for the copy in flight, then copy the newest local checkpoint if the durable tier has not its
        step (one not due, or skipped); raise what failed. A durable tier found down, its error raised with
        nothing saved since, is not tried again: a run that stops on it ends within its bound, not twice it."""
        _UNFINISHED.discard(self)
        try:
            self.wait()
        except BaseException:
            self.told_at = self.newest.step if self.newest is not None else None
            raise
        finally:
            if self._worth_a_last_copy():
                self.copy(self.newest)
        self.wait()

    def _worth_a_last_copy(self) -> bool:
        """Whether the newest local checkpoint lacks its durable copy and may get it: not when the durable
        tier was found down with nothing saved since (a run stopping on that error); a loop that went on
        saving after it tries again."""
        newest = self.newest
        if newest is None or (self.copied is not None and newest.step <= self.copied) or not newest.path.exists():
            return False
        return not (self.told_at == newest.step and self.durable.gave_up())

    def wait(self) -> None:
        """Block until no copy is in flight; raise the error of the last one if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


def _check_every(every: object) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise FieldError(f"durable_every must be a whole number of steps of at least 1, got {every!r}", "durable_every")
    return every
