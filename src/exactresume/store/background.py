"""Checkpoints written in the background: the training loop does not wait for the disk.

    saver = BackgroundSaver(store)
    saver.save(step, parts)   # returns at once; a thread copies the state, then writes it
    saver.wait()              # the save in flight is durable and verified, or its error is raised

`save` takes the parts' state dicts (references to the live tensors, plus small values such as RNG
states, which are copies already) and hands them to a writer thread. The thread first copies the
tensors into staging memory, while the loop runs the next step's forward and backward, which only
read them; the next `optimizer.step()` waits until the copy is complete (a step pre-hook on every
optimizer among the parts), so the file holds exactly the state at `step`, byte for byte what
`store.save` would have written. A loop that changes the state in place before its next optimizer
step (an EMA of the weights, BatchNorm statistics in the forward pass) passes `overlap=False`, and
`save` then returns only once the copy is made.

The thread then runs the store's own stages (`CheckpointStore.commit`: write, fsync, rename, folder
fsync, verify, retention) in the same order, so old checkpoints are still deleted only after the new
one is durable and reads back verified, and a kill at any moment leaves what a kill of a synchronous
save leaves. At most one save is in flight: `save` first waits for the previous one and reuses its
staging memory (the copy is kept between saves, so a background-saving run holds one extra copy of
its state). A failure in the background is raised by the next `save` or `wait` (or by the optimizer
step that waits for the copy) as BackgroundSaveFailed, naming the step it was saving.
`blocked_seconds` adds up the time the caller spent waiting in `save` and in the pre-hook.

`save(..., coalesce=True)` (`train --save-every 1 --async-save`) does not wait when the previous save is still being
written: it skips this one and counts it in `coalesced`, so a disk slower than one checkpoint per
step costs checkpoints, not training time. Nothing is queued; the next save after the write ends
takes the state of its own step.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exactresume.store.folder import CheckpointStore
from exactresume.store.numbered import snapshot

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


class BackgroundSaveFailed(Exception):
    """The background save of `step` raised `error` (kept as the cause)."""

    def __init__(self, step: int, error: BaseException):
        super().__init__(step, error)
        self.step, self.error = step, error


class StagingMemory:
    """Reusable CPU copies of a state's tensors; tensors that share storage keep sharing it.

    Storages, not tensors, are copied, because that is what torch.save writes: tied weights stay one
    record, and a view keeps its offset and strides.
    """

    def __init__(self) -> None:
        self.pool: list[torch.UntypedStorage] = []  # the n-th distinct storage of the last copy

    def copy(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this staging memory."""
        return self._copy(state, {})

    def _copy(self, value: Any, staged: dict) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, staged)
        if isinstance(value, dict):
            copied = copy.copy(value)  # keeps the type and attributes (a state dict's _metadata)
            for key, item in value.items():
                copied[key] = self._copy(item, staged)
            return copied
        if isinstance(value, list):
            return [self._copy(item, staged) for item in value]
        if type(value) is tuple:
            return tuple(self._copy(item, staged) for item in value)
        return copy.deepcopy(value)  # numbers, strings, numpy RNG arrays: small

    def _copy_tensor(self, tensor: torch.Tensor, staged: dict) -> torch.Tensor:
        source = tensor.untyped_storage()
        key = (source.data_ptr(), source.device, source.nbytes())
        target = staged.get(key) if source.nbytes() else None
        if target is None:
            target = self._storage(len(staged), source.nbytes())
            target.copy_(source)
            staged[key] = target
        return torch.empty(0, dtype=tensor.dtype).set_(target, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _storage(self, index: int, nbytes: int) -> torch.UntypedStorage:
        if index < len(self.pool) and self.pool[index].nbytes() == nbytes:
            return self.pool[index]
        storage = torch.UntypedStorage(nbytes)
        if index < len(self.pool):
            self.pool[index] = storage
        else:
            self.pool.append(storage)
        return storage


class BackgroundSaver:
    """`store.save` split in two: state dicts taken in the caller's thread, copy and write in a writer thread."""

    def __init__(self, store: CheckpointStore, overlap: bool = True):
        self.store, self.overlap, self.staging = store, overlap, StagingMemory()
        self.blocked_seconds = 0.0
        self.coalesced = 0  # saves skipped because the previous one was still being written
        self._writer: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._failure: BackgroundSaveFailed | None = None
        self._hooked: set[int] = set()

    def busy(self) -> bool:
        """Whether a save is still being copied or written."""
        return self._writer is not None and self._writer.is_alive()

    def save(self, step: int, parts: Mapping[str, Stateful], coalesce: bool = False) -> Path | None:
        """Wait for the previous save, start this one; the path the checkpoint will have.

        With `coalesce`, a save asked for while the previous one is still busy is skipped (None)."""
        if coalesce and self.busy():
            self.coalesced += 1
            return None
        started = time.perf_counter()
        self.wait()
        self.store.faults.reached("snapshot")
        state = snapshot(step, parts)
        self._hook_optimizers(parts)
        self._copied.clear()
        # Not a daemon: an exiting interpreter lets a started save finish rather than cut it off.
        self._writer = threading.Thread(target=self._copy_and_commit, args=(step, state), name=f"checkpoint-{step}")
        self._writer.start()
        if not self.overlap:
            self._copied.wait()
        self.blocked_seconds += time.perf_counter() - started
        return self.store.path_for(step)

    def wait_for_copy(self) -> None:
        """Block until the save in flight has copied the state (the live tensors may change after)."""
        if not self._copied.is_set():
            started = time.perf_counter()
            self._copied.wait()
            self.blocked_seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Block until no save is in flight; raise BackgroundSaveFailed if the last one failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Wait for the save in flight (the Saver interface; the staging memory is kept for reuse)."""
        self.wait()

    def _hook_optimizers(self, parts: Mapping[str, Stateful]) -> None:
        for part in parts.values():
            optimizer = getattr(part, "part", part)  # a part may wrap its object (resume.PerRank)
            if isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in self._hooked:
                optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.wait_for_copy())
                self._hooked.add(id(optimizer))

    def _copy_and_commit(self, step: int, state: dict) -> None:
        # Hand the interpreter lock back at once: a new thread otherwise keeps it while it runs Python,
        # and `save` (waiting in Thread.start) would return only after tens of milliseconds.
        time.sleep(0)
        try:
            try:
                state = self.staging.copy(state)
            finally:
                self._copied.set()  # a failed copy must not leave the loop waiting
            self.store.commit(step, state)
        except BaseException as error:  # handed to the training thread, which decides
            self._failure = BackgroundSaveFailed(step, error)
