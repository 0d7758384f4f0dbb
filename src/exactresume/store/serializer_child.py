"""The serializer process's side (serializer.py has the training process's): torch.save of each state the
training process staged in shared memory, into shared memory of this process's own, which the training
process writes to the checkpoint file.

Started by serializer.py as `python -c` (never through multiprocessing's spawn, which would run the
user's script again in a script without a `__main__` guard); it serves one socket and ends when the
training process closes it or dies.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import traceback
from typing import Any, BinaryIO

import torch

from exactresume.store.sealed import save_unsealed

HEADER = struct.Struct("<Q")  # every message: its length, then its pickle
MOST_FDS = 2
_ARENA: list[torch.UntypedStorage] = []  # the storages of the arena last sent, which a slot's index names


def tensor_at(index: int, dtype: torch.dtype, offset: int, size: tuple, stride: tuple) -> torch.Tensor:
    """A staged tensor rebuilt on its arena storage (a skeleton's slot, unpickled): as the training process
    staged it, so torch.save writes the same bytes. Index -1: an empty storage of its own."""
    storage = _ARENA[index] if index >= 0 else torch.UntypedStorage(0)
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def send(sock: socket.socket, message: Any, fds: list[int] | tuple = ()) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [HEADER.pack(len(payload))], list(fds))
    sock.sendall(payload)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the file descriptors sent with it; EOFError once the other side closed."""
    header, fds, _flags, _address = socket.recv_fds(sock, HEADER.size, MOST_FDS)
    if not header:
        raise EOFError
    header += _exactly(sock, HEADER.size - len(header))
    return pickle.loads(_exactly(sock, HEADER.unpack(header)[0])), fds


def _exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _map_arena(fd: int, layout: list[tuple[int, int]]) -> None:
    """The storages of a new arena: each (offset, bytes) a slice of the shared file `fd`."""
    size = max((offset + nbytes for offset, nbytes in layout), default=0)
    mapped = mmap.mmap(fd, max(size, 1))
    os.close(fd)  # the map keeps the memory
    _ARENA[:] = [
        torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
        if nbytes
        else torch.UntypedStorage(0)
        for offset, nbytes in layout
    ]


def serve(fd: int) -> None:
    """Answer each staged state with the size of its torch.save bytes in this process's shared file, until
    the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to answer; EOF ends this one
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    out_fd = os.memfd_create("exactresume-serialized", os.MFD_CLOEXEC)
    out = os.fdopen(out_fd, "w+b", closefd=False)
    try:
        send(sock, "ready", [out_fd])
        while True:
            _answer(sock, out, *receive(sock))
    except (EOFError, ConnectionError):  # the training process closed the socket, or died (even as this started)
        return


def _answer(sock: socket.socket, out: BinaryIO, message: tuple, fds: list[int]) -> None:
    layout, skeleton = message
    try:
        if fds:
            _map_arena(fds[0], layout)
        out.seek(0)
        save_unsealed(pickle.loads(skeleton), out)
        out.flush()
        answer = (out.tell(), None)
    except Exception:  # the training process falls back to its own torch.save, which raises it there
        answer = (0, traceback.format_exc())
    send(sock, answer)
