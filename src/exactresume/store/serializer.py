"""A background save's torch.save run in a process of its own (`serializer="process"`): the training
process keeps the interpreter lock.

A background save's writer is a thread of the training process, and while it pickles the state (torch's
Python `persistent_id` for each of thousands of objects, and the copy of every byte into the file, both
under the interpreter lock) the training loop's own Python waits: on the default preset a save every step
cost 5-6 % of the steps/s (docs/performance.md). With this serializer the staged copy of the state lives
in memory shared with a helper process (an anonymous shared file, `memfd`, one slice per storage); the
writer sends it the state's skeleton, every tensor replaced by a slot naming its slice (a plain pickle of
a few kilobytes), and the helper runs torch.save on it into shared memory of its own. The writer then
writes those bytes to the checkpoint file, which the store seals, syncs, renames and reads back as for
any save: every stage that makes a checkpoint (and every fault point) stays in the training process, the
helper only turns a state into bytes. The bytes are those the writer's own torch.save would have written
(tests/test_serializer.py).

The helper is started at the first save and takes a few seconds to import torch; saves until it is ready
are pickled by the writer, as they are when it fails (its error is then the writer's own torch.save's)
and after it dies (said once on stderr). It ends when the store closes or the training process dies (its
socket closes). Linux only (memfd); elsewhere the writer pickles.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from exactresume.errors import notice
from exactresume.store.resume import rebuilt
from exactresume.store.sealed import Serialized
from exactresume.store.serializer_child import receive, send, tensor_at

THREAD, PROCESS = "thread", "process"  # where a background save is pickled: a store's `serializer`
ALIGNMENT = 64  # each storage's slice starts on a cache line, as torch's own allocations do
START = (  # the helper's command: this process's import path, then the socket to serve
    "import json, sys; sys.path[:0] = json.loads(sys.argv[2]); "
    "from exactresume.store.serializer_child import serve; serve(int(sys.argv[1]))"
)
STOP_SECONDS = 5.0  # how long `close` waits for the helper to end before it is killed


def available() -> bool:
    return hasattr(os, "memfd_create")


class SharedArena:
    """Staging storages the helper maps too: slices of one anonymous shared file, one per storage."""

    def __init__(self, sizes: list[int]):
        self.layout, end = [], 0
        for nbytes in sizes:
            self.layout.append((end, nbytes))
            end += -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.fd = os.memfd_create("exactresume-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(end, 1))
        self._map = mmap.mmap(self.fd, max(end, 1))
        self.storages = [self._storage(offset, nbytes) for offset, nbytes in self.layout]
        self.index = {storage.data_ptr(): number for number, storage in enumerate(self.storages) if storage.nbytes()}

    def _storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        if not nbytes:
            return torch.UntypedStorage(0)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()

    def close(self) -> None:
        """The training process's hold on the file (the map goes with the last storage over it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Slot:
    """A staged tensor in a skeleton: unpickled in the helper as that tensor on its arena slice."""

    def __init__(self, arena: SharedArena, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self.index = arena.index[storage.data_ptr()] if storage.nbytes() else -1  # empty: not staged
        self.tensor = tensor

    def __reduce__(self) -> tuple:
        tensor = self.tensor
        return tensor_at, (
            self.index,
            tensor.dtype,
            tensor.storage_offset(),
            tuple(tensor.size()),
            tuple(tensor.stride()),
        )


class SerializerProcess:
    """The helper of one background writer: started at its first request, ended by `close`."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._out_fd = -1  # the helper's shared file of serialized bytes, once it said it is ready
        self._out_map: mmap.mmap | None = None
        self._arena_sent: SharedArena | None = None
        self._gone = not available()
        self._lock = threading.Lock()  # one request at a time

    @contextmanager
    def serialized(self, staged: Any, arena: SharedArena) -> Iterator[Any]:
        """`staged` (whose tensors lie in `arena`) as the helper's torch.save bytes, or `staged` itself where
        the writer must pickle it: the helper not ready yet, failed on it, or gone.

        The bytes are read until the checkpoint file is written: the next save asks the helper only
        once this one is published (background.py), so it never overwrites bytes still to be written."""
        with self._lock:
            size = self._ask(staged, arena)
        if size is None:
            yield staged
            return
        with memoryview(self._mapped(size))[:size] as view:
            yield Serialized(view)

    def _mapped(self, size: int) -> mmap.mmap:
        """The helper's bytes, through one map kept between saves: a map made and unmapped at every save
        costs the loop's thread (sealed._hash_read says how). Made anew, over the whole file, when a save
        outgrows it (the one before goes once no view holds it)."""
        if self._out_map is None or len(self._out_map) < size:
            self._out_map = mmap.mmap(self._out_fd, os.fstat(self._out_fd).st_size, prot=mmap.PROT_READ)
        return self._out_map

    def _ask(self, staged: Any, arena: SharedArena) -> int | None:
        if not self._ready():
            return None
        try:
            skeleton = pickle.dumps(rebuilt(staged, lambda tensor: _Slot(arena, tensor)), pickle.HIGHEST_PROTOCOL)
        except Exception:  # what plain pickle cannot take: the writer's torch.save says what (or takes it)
            return None
        fresh = arena is not self._arena_sent
        try:
            send(self._socket, (arena.layout if fresh else None, skeleton), [arena.fd] if fresh else [])
            self._arena_sent = arena
            (size, failure), _fds = receive(self._socket)
        except (OSError, EOFError):
            self._lost("it ended")
            return None
        return None if failure else size

    def _ready(self) -> bool:
        """Whether the helper can take a request now; starts it on the first call."""
        if self._gone:
            return False
        if self._process is None:
            self._start()
            return False
        if self._out_fd < 0:
            if not select.select([self._socket], [], [], 0)[0]:
                if self._process.poll() is not None:
                    self._lost("it did not start")
                return False
            try:
                _ready, fds = receive(self._socket)
                self._out_fd = fds[0]
            except (OSError, EOFError, IndexError):
                self._lost("it did not start")
                return False
        return True

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            command = [sys.executable, "-c", START, str(theirs.fileno()), json.dumps(sys.path)]
            self._process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except OSError as error:
            ours.close()
            self._lost(f"it could not start ({error.strerror or error})")
        else:
            self._socket = ours
        finally:
            theirs.close()

    def _lost(self, why: str) -> None:
        if not self._gone:
            notice(f"the process that pickles background saves is gone ({why}): saves are pickled by the writer thread")
        self._gone = True
        self.close()

    def close(self) -> None:
        """End the helper: its socket closed, it exits (killed if it has not within STOP_SECONDS, or at once
        while it is still starting: a short run does not wait for its import of torch)."""
        if self._process is not None and self._out_fd < 0:
            self._process.kill()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._out_fd >= 0:
            os.close(self._out_fd)
            self._out_fd, self._out_map = -1, None
        if self._process is not None:
            try:
                self._process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._arena_sent = None
