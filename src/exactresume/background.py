"""Checkpoints written in the background: the training loop waits only for a copy of the state.

    saver = BackgroundSaver(store)
    saver.save(step, parts)   # copies the state into staging memory and returns; a thread writes it
    saver.wait()              # the save in flight is durable and verified, or its error is raised

The copy is taken between optimizer steps, so the file holds exactly what `store.save` would have
written at that step, byte for byte. The thread runs the store's own stages (`CheckpointStore.commit`:
write, fsync, rename, folder fsync, verify, retention) in the same order, so old checkpoints are
still deleted only after the new one is durable and reads back verified, and a kill at any moment
leaves what a kill of a synchronous save leaves.

At most one save is in flight: `save` first waits for the previous one and then reuses its staging
memory. Copying into memory that is already touched runs at memory speed, where fresh allocations
page-fault (and this VM hands idle memory back to its host), so the staging copy is kept between
saves: a background-saving run holds one extra copy of its state. A failure in the background is
raised by the next `save` or `wait` as BackgroundSaveFailed, naming the step it was saving.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from .parts import Stateful
from .store import CheckpointStore, snapshot


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
    """`store.save` split in two: a copy in the caller's thread, the rest in a writer thread."""

    def __init__(self, store: CheckpointStore):
        self.store, self.staging = store, StagingMemory()
        self._writer: threading.Thread | None = None
        self._failure: BackgroundSaveFailed | None = None

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Path:
        """Wait for the previous save, copy `parts`, start writing them; the path the checkpoint will have."""
        self.wait()
        self.store.faults.reached("snapshot")
        state = self.staging.copy(snapshot(step, parts))
        # Not a daemon: an exiting interpreter lets a started save finish rather than cut it off.
        self._writer = threading.Thread(target=self._commit, args=(step, state), name=f"checkpoint-{step}")
        self._writer.start()
        return self.store.path_for(step)

    def wait(self) -> None:
        """Block until no save is in flight; raise BackgroundSaveFailed if the last one failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    @property
    def in_flight(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def _commit(self, step: int, state: dict) -> None:
        try:
            self.store.commit(step, state)
        except BaseException as error:  # handed to the training thread, which decides
            self._failure = BackgroundSaveFailed(step, error)
