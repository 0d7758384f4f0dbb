"""Checkpoints written in the background: the training loop does not wait for the disk.

    store = CheckpointStore(folder, background=True)
    store.save(step, parts)   # returns once the state is copied; a thread writes it
    store.wait()              # the save in flight is durable and verified, or its error is raised

A store given `background=True` hands its saves to a BackgroundWriter, this module's one class.

`copy` says when the state is copied into staging memory, the one thing the loop must wait for:

- "before-return" (the default): `save` copies it before it returns. The file holds exactly the
  state at `step`, whatever the loop changes next: an EMA of the weights, BatchNorm's running
  statistics in the next forward, anything changed in place.
- "during-next-step": `save` returns at once, and the writer thread copies the state while the loop
  runs the next step's forward and backward, which only read it. The state must not change until
  the loop waits for the copy: the next `optimizer.step()` of every optimizer among the parts does
  (a step pre-hook), and so do `wait_for_copy()`, `save`, `wait` and `close`. There the loop's own
  thread compares the tensors' version counters with those at `save` (copy_guard.py, which says
  what they miss), and only then is the file published (the writer writes it meanwhile, and renames
  it only after that); a change refuses the save, every time, not
  only when it raced the copy: no file is written for that step, and a one-line CheckpointError
  naming the tensor is raised there. For a loop that changes the state only in its optimizer's
  step (as `exactresume train --async-save` does), the file is the same as with "before-return".

Either way the file is byte for byte what `store.save` would have written, and the thread runs the
store's own stages (`CheckpointStore.commit`: write, fsync, rename, folder fsync, verify, retention)
in the same order, so old checkpoints are still deleted only after the new one is durable and reads
back verified, and a kill at any moment leaves what a kill of a synchronous save leaves. One save
is written at a time: `save` first waits for the previous one to be published (durable at its name)
and reuses its staging memory (the copy is kept between saves, so a background-saving run holds one
extra copy of its state); what is left of that one, its read-back and pruning, is not waited for
there: the new save is copied and written meanwhile, and renamed into place only once that one has
ended, so saves are published, verified and pruned in their order.

A failure in the background is raised by the store's next `save`, `wait`, `close` or `load` (or the
optimizer step that waits for the copy) as itself when it is a UserError, as the store's one-line
StorageError when the storage refused a write (naming the step, the error and the newest checkpoint,
which is intact), and as itself, with its traceback, when it is anything else (a bug); where no call
was left to raise it (a script that ends without `close`), it is said on stderr at the exit.
`blocked_seconds` adds up the time the caller spent waiting in `save` and for the copy.

`store.save(..., coalesce=True)` (`train --save-every 1 --async-save`) does not wait when the previous
save's file is still being written (`busy()`): the store skips that one and counts it, so a disk slower
than one checkpoint per step costs checkpoints, not waits. Nothing is queued; the next save after
the write ends takes the state of its own step.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from exactresume.errors import FieldError, StorageError, tell_unraised
from exactresume.store.copy_guard import CopyGuard
from exactresume.store.place import Publishing
from exactresume.store.resume import capture, rebuilt
from exactresume.store.seal_hash import thread_in_this_context
from exactresume.store.serializer import PROCESS, THREAD, SerializerProcess, SharedArena, available

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from exactresume.store.faults import FaultPoints

BEFORE_RETURN, DURING_NEXT_STEP = "before-return", "during-next-step"  # a background store's `copy`


@dataclass
class _Milestones:
    """How far a background save has got: its file written (its staging memory free, `busy()` no more),
    and published (durable at its name: the next save may begin)."""

    written: threading.Event = field(default_factory=threading.Event)
    published: threading.Event = field(default_factory=threading.Event)

    def reached_all(self) -> None:
        """The save ended, written or not: nothing waits for it any more."""
        self.written.set()
        self.published.set()


class _AfterAFailure(Exception):
    """A save not published because the one before it failed (that failure is what is raised)."""


class _ArenaMisfit(Exception):
    """The state's storages are not those the shared arena was made for: it is made anew."""


class StagingMemory:
    """Reusable CPU copies of a state's tensors; tensors that share storage keep sharing it.

    Storages, not tensors, are copied, because that is what torch.save writes: tied weights stay one
    record, and a view keeps its offset and strides. `shared`: the storages are slices of one arena
    that the serializer process maps too (serializer.py), made anew when the state's storages change.
    """

    def __init__(self, shared: bool = False) -> None:
        self.pool: list[torch.UntypedStorage] = []  # the n-th distinct storage of the last copy
        self.shared, self.arena = shared, None
        # The last copy's pairs, by the source storage's key: (pool index, target storage, target bytes,
        # source bytes). Kept, a save every step makes no byte views (a quarter of a copy's Python); a
        # pair holds its source storage, so no other storage can come to have its key meanwhile.
        self._pairs: dict[tuple, tuple[int, torch.UntypedStorage, torch.Tensor, torch.Tensor]] = {}

    def copy(self, state: Any, after_each: Callable[[torch.Tensor], None] | None = None) -> Any:
        """A copy of `state` whose tensors live in this staging memory; `after_each(tensor)` follows
        the copy of each of its tensors."""
        try:
            return self._copy(state, after_each)
        except _ArenaMisfit:
            self._fit_arena(_storage_sizes(state))
            return self._copy(state, after_each)

    def forget_sources(self) -> None:
        """Hold none of the state's storages (the copies stay, for the next save)."""
        self._pairs = {}

    def _copy(self, state: Any, after_each: Callable[[torch.Tensor], None] | None) -> Any:
        pairs: dict = {}

        def stage(tensor: torch.Tensor) -> torch.Tensor:
            copied = self._copy_tensor(tensor, pairs)
            if after_each is not None:
                after_each(tensor)
            return copied

        staged = rebuilt(state, stage)
        self._pairs = pairs
        return staged

    def _fit_arena(self, sizes: list[int]) -> None:
        if self.arena is not None:
            self.arena.close()
        self.arena = SharedArena(sizes)
        self.pool, self._pairs = list(self.arena.storages), {}

    def _copy_tensor(self, tensor: torch.Tensor, pairs: dict) -> torch.Tensor:
        source = tensor.untyped_storage()
        key = _storage_key(source)
        if not key[2]:  # nothing to copy nor to share (every empty storage has the same key)
            target = torch.UntypedStorage(0)
        else:
            pair = pairs.get(key)
            if pair is None:
                pair = pairs[key] = self._pair(key, source, len(pairs))
                # Copied as byte tensors: a tensor's copy_ lets go of the interpreter lock while it copies, a
                # storage's holds it, and the loop's thread waits for every millisecond the writer holds it.
                pair[2].copy_(pair[3])
            target = pair[1]
        return torch.empty(0, dtype=tensor.dtype).set_(target, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _pair(self, key: tuple, source: torch.UntypedStorage, index: int) -> tuple:
        kept = self._pairs.get(key)
        if kept is not None and kept[0] == index:  # the pool changes only in a copy, whose pairs these are
            return kept
        target = self._storage(index, key[2])
        return index, target, _bytes_of(target), _bytes_of(source)

    def _storage(self, index: int, nbytes: int) -> torch.UntypedStorage:
        if index < len(self.pool) and self.pool[index].nbytes() == nbytes:
            return self.pool[index]
        if self.shared:
            raise _ArenaMisfit
        storage = torch.UntypedStorage(nbytes)
        if index < len(self.pool):
            self.pool[index] = storage
        else:
            self.pool.append(storage)
        return storage


def _storage_key(storage: torch.UntypedStorage) -> tuple:
    return storage.data_ptr(), storage.device, storage.nbytes()


def _storage_sizes(state: Any) -> list[int]:
    """The bytes of each distinct storage of `state`'s tensors, in the order `StagingMemory.copy` meets them."""
    sizes: dict[tuple, int] = {}

    def note(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor.untyped_storage())
        if key[2]:  # an empty storage is not staged (`_copy_tensor`)
            sizes.setdefault(key, key[2])
        return tensor

    rebuilt(state, note)
    return list(sizes.values())


_WRITERS: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _tell_what_was_never_raised() -> None:
    """At the interpreter's exit (after its threads ended): the failure of a save that no call was
    left to raise (a script that ends without `close`), its line, or a bug's traceback."""
    for writer in list(_WRITERS):
        failure, writer._failure = writer._failure, None
        if failure is not None:
            tell_unraised(failure)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Stages(Protocol):
    """What the writer needs of its store (numbered.py's CheckpointStore): its step check, its commit
    stages and their fault points, and its one line for a refused write."""

    folder: Any
    faults: FaultPoints

    def check_save(self, step: Any) -> int: ...
    def hold_lock(self) -> None: ...
    def reached(self, step: int) -> None: ...
    def commit(self, step: int, state: dict, publishing: Publishing | None = None) -> Any: ...
    def path_for(self, step: int) -> Any: ...
    def storage_error(self, step: int, error: OSError) -> StorageError: ...


class BackgroundWriter:
    """A store's `save` split in two: the state copied, then written by a writer thread.

    `copy="before-return"` (the default): `save` returns once the state is copied; the file holds the
    state at its step whatever the loop changes next. `copy="during-next-step"`: `save` returns at
    once, the copy runs during the next step, and the state must not change until the loop waits
    for it (the optimizer's step, or `wait_for_copy()`); a change refuses the save (module docstring).
    """

    def __init__(self, store: Stages, copy: str = BEFORE_RETURN, serializer: str = THREAD):
        if copy not in (BEFORE_RETURN, DURING_NEXT_STEP):
            raise FieldError(f"copy must be {BEFORE_RETURN!r} or {DURING_NEXT_STEP!r}, got {copy!r}", "copy")
        if serializer not in (THREAD, PROCESS):
            raise FieldError(f"serializer must be {THREAD!r} or {PROCESS!r}, got {serializer!r}", "serializer")
        in_a_process = serializer == PROCESS and available()
        self.store, self.copy, self.staging = store, copy, StagingMemory(shared=in_a_process)
        self.serializer = SerializerProcess() if in_a_process else None
        self.blocked_seconds = 0.0
        self._writer: threading.Thread | None = None
        self._guard: CopyGuard | None = None  # the copy in flight, with copy="during-next-step"
        self._milestones: _Milestones | None = None  # how far the save in flight has got
        self.step: int | None = None  # the step of the save in flight, or of the last one
        self._failure: BaseException | None = None
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle
        _WRITERS.add(self)

    def busy(self) -> bool:
        """Whether a save is still being copied or written (its file not yet ready to be published)."""
        return self._milestones is not None and not self._milestones.written.is_set()

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Path:
        """Wait for the previous save to be published, start this one; the path the checkpoint will have."""
        started = time.perf_counter()
        self._wait_for_publication()
        step = self.store.check_save(step)
        try:  # here, not in the writer: another store of the folder is refused at its own call, not this save
            self.store.hold_lock()
        except OSError as error:
            raise self.store.storage_error(step, error) from error
        self.store.faults.reached("snapshot")
        state = capture(parts, step, self.store.identity)
        if self.copy == BEFORE_RETURN:
            state, self._guard = self.staging.copy(state), None
        else:
            # The containers and small values are made the writer's own now, as a part may return live
            # ones (a list it appends to); the tensors, whose changes the guard sees, are copied later.
            state = rebuilt(state, lambda tensor: tensor)
            self._guard = CopyGuard(step, state)
            self._hook_optimizers(parts)
        before, self._milestones, self.step = self._writer, _Milestones(), step
        # Not a daemon: an exiting interpreter lets a started save finish rather than cut it off.
        work = (step, state, self._guard, before, self._milestones)
        self._writer = thread_in_this_context(self._write, work, f"checkpoint-{step}")
        self._writer.start()
        self.blocked_seconds += time.perf_counter() - started
        return self.store.path_for(step)

    def wait_for_copy(self) -> None:
        """Block until the save in flight has copied the state; from then on the state may change.
        Raises the save's CheckpointError if the state changed before (no file is published then)."""
        guard = self._guard
        if guard is None or guard.passed():
            return
        started = time.perf_counter()
        guard.copied.wait()
        guard.decide()  # here the loop has nothing running: every change it made is counted
        self.blocked_seconds += time.perf_counter() - started
        if not guard.passed():
            self.wait()  # the writer ends without writing; its error is raised here

    def _wait_for_publication(self) -> None:
        """Block until the save in flight is durable at its name (its staging memory free). What is left of it,
        its read-back and pruning, goes on while the loop does: the next save is written meanwhile and
        published after it. A save that failed, or one that ended, is waited for whole (its error raised)."""
        if self._guard is not None:  # the writer waits for this thread's decision
            self._guard.copied.wait()
            self._guard.decide()
        if self._milestones is not None:
            self._milestones.published.wait()
        if self._failure is not None or (self._writer is not None and not self._writer.is_alive()):
            self.wait()

    def wait(self) -> None:
        """Block until no save is in flight; raise the error of the last one if it failed."""
        if self._writer is not None:
            if self._guard is not None:  # the writer waits for this thread's decision
                self._guard.copied.wait()
                self._guard.decide()
            self._writer.join()
            self._writer = None
        self._guard = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Wait for the save in flight and take the optimizers' pre-hooks off (the staging memory is
        kept for reuse)."""
        try:
            self.wait()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            self.staging.forget_sources()
            if self.serializer is not None:
                self.serializer.close()

    def _hook_optimizers(self, parts: Mapping[str, Stateful]) -> None:
        for part in parts.values():
            optimizer = getattr(part, "part", part)  # a part may wrap its object (resume.PerRank)
            if isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in self._hooks:
                hook = lambda optimizer, args, kwargs: self.wait_for_copy()
                self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(hook)

    def _write(
        self,
        step: int,
        state: dict,
        guard: CopyGuard | None,
        before: threading.Thread | None,
        milestones: _Milestones,
    ) -> None:
        # Hand the interpreter lock back at once: a new thread otherwise keeps it while it runs Python,
        # and `save` (waiting in Thread.start) would return only after tens of milliseconds.
        time.sleep(0)
        try:
            staged = state if guard is None else self._copy_guarded(state, guard)
            publishing = Publishing(
                functools.partial(self._ready_to_publish, guard, before, milestones),
                functools.partial(self._published, step, milestones),
            )
            with self._serialized(staged) as payload:
                self.store.commit(step, payload, publishing=publishing)
        except _AfterAFailure:
            pass  # the save before failed: this one is not published, and that failure is raised next
        except OSError as error:
            self._failure = self.store.storage_error(step, error)
        except BaseException as error:  # a UserError as it is; anything else is a bug: its own traceback
            self._failure = error
        finally:
            if before is not None:
                before.join()  # no writer outlives the one a `wait` joins
            milestones.reached_all()

    def _serialized(self, staged: Any) -> contextlib.AbstractContextManager[Any]:
        """What the store writes: the staged state, or its bytes pickled by the serializer process."""
        if self.serializer is None:
            return contextlib.nullcontext(staged)
        return self.serializer.serialized(staged, self.staging.arena)

    def _ready_to_publish(
        self, guard: CopyGuard | None, before: threading.Thread | None, milestones: _Milestones
    ) -> None:
        """Just before the file is renamed into place: the loop's decision on the copy (copy_guard.py), then
        the save before ended (saves are published in their order), and not failed."""
        if guard is not None:
            guard.confirm()
        milestones.written.set()  # the staging memory is the next save's: no save asked for from now is skipped
        if before is not None:
            before.join()
        if self._failure is not None:
            raise _AfterAFailure

    def _published(self, step: int, milestones: _Milestones) -> None:
        """The file is durable at its name: the store's own from now on, as a synchronous save's once it
        returns, before the loop may save again (a save at the same step writes over it, not beside another run's)."""
        self.store.reached(step)
        milestones.published.set()

    def _copy_guarded(self, state: dict, guard: CopyGuard) -> dict:
        try:
            state = self.staging.copy(state, guard.check_copied)
            guard.check_all()
        except BaseException:
            guard.refuse()
            raise
        finally:
            guard.copied.set()  # a failed copy must not leave the loop waiting
        return state
