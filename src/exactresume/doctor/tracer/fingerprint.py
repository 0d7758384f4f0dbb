"""Fingerprints of tensors, nested containers and RNG states, and short summaries of saved objects.

The tracer runs in the user's Python, which may have torch and nothing else: the hash is xxh3 where
xxhash is importable, BLAKE2b (the standard library) otherwise, chosen once as the tracer starts (so
in every run of one doctor, which share a Python and environment; EXACTRESUME_TRACE_HASH=blake2b, a
variable the warm fork server keeps, forces BLAKE2b); numpy is used only once the script has loaded it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import sys
from collections.abc import Iterable, Iterator

import torch

try:
    import xxhash
except Exception:  # not installed, or a build this Python cannot load: the standard library's hash instead
    xxhash = None

HALF_DTYPES = ("torch.float16", "torch.bfloat16")


def _stdlib_hasher():
    return hashlib.blake2b(digest_size=8)


def use_stdlib_hash(stdlib: bool = True) -> None:
    """Hash with BLAKE2b even where xxhash is installed (what a Python without xxhash costs: the bench), or
    with xxh3 again where it is (`stdlib=False`)."""
    global new_hasher, HASH
    if stdlib or xxhash is None:
        new_hasher, HASH = _stdlib_hasher, "blake2b-64"
    else:
        new_hasher, HASH = xxhash.xxh3_64, "xxh3_64"


# The hash every fingerprint of this process uses, and its name (each trace's start event says it);
# EXACTRESUME_TRACE_HASH=blake2b forces the standard library's, as in a Python without xxhash.
new_hasher, HASH = _stdlib_hasher, "blake2b-64"
use_stdlib_hash(os.environ.get("EXACTRESUME_TRACE_HASH") == "blake2b")


HEADERS: dict[tuple, bytes] = {}  # (dtype, shape) -> its header, made once: a step hashes ~100 tensors


def header(tensor: torch.Tensor) -> bytes:
    key = (tensor.dtype, tensor.shape)
    if key not in HEADERS:
        HEADERS[key] = f"T{tensor.dtype}{tuple(tensor.shape)}".encode()
    return HEADERS[key]


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in a contiguous CPU tensor of their own dtype: itself when it is one already."""
    if tensor.is_cpu and tensor.layout is torch.strided and tensor.is_contiguous() and not tensor.is_conj():
        return tensor
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.to(torch.uint8) if flat.dtype == torch.bool else flat


def raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read in place through their address (a third of the cost of
    .numpy(), which needs numpy): the caller keeps the tensor alive while it reads them."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def update(hasher, value) -> None:
    """Feed one value into `hasher`: tensors by dtype, shape and bytes; containers element by element."""
    if isinstance(value, torch.Tensor):
        hasher.update(header(value))
        if value.numel():
            values = plain(value)  # held here while raw() reads it
            hasher.update(raw(values))
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in value:
            hasher.update(repr(key).encode())
            update(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)) and len(value) > 0 and all(type(item) is int for item in value):
        hasher.update(b"I" + repr(value).encode())  # python's RNG state: 625 ints at once, not one by one
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            update(hasher, item)
        hasher.update(b"]")
    elif _is_ndarray(value):
        hasher.update(f"A{value.dtype}{value.shape}".encode())
        hasher.update(sys.modules["numpy"].ascontiguousarray(value).tobytes())
    else:
        hasher.update(repr(value).encode())


def _is_ndarray(value) -> bool:
    """A numpy array, without importing numpy: only a script that loaded numpy can hold one."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def digest(*values) -> str:
    hasher = new_hasher()
    for value in values:
        update(hasher, value)
    return hasher.hexdigest()


def hexdigest(data) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return hasher.hexdigest()


def settings_digest(settings: list[dict]) -> str:
    """A digest of plain settings (an optimizer's hyperparameters) through their repr, which is exact for
    numbers, strings and tuples of them: one hash, not one per value. A tensor among them (its repr
    rounds) goes through digest()."""
    text = repr(settings)
    return digest(settings) if "tensor(" in text else "r" + hexdigest(text.encode())


MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _numpy_rng_digest(np) -> str:
    """numpy's global RNG state read in place (np.random.get_state() costs 0.1 ms, a step's worth on a tiny
    model); a legacy Gaussian cached by the RandomState is not in it."""
    generator = np.random.get_bit_generator()
    if type(generator).__name__ != "MT19937":
        return digest(list(np.random.get_state()))
    state = (ctypes.c_char * MT19937_STATE_BYTES).from_address(generator.ctypes.state_address)
    return hexdigest(memoryview(state).cast("B"))


def python_rng_digest(rng=random) -> str:
    """A Python RNG's state (the global one, or a random.Random): the hash of its 625 ints (an int's hash is
    not salted), and the cached Gaussian by value (hashing the whole state would hash None, whose hash is its
    address on 3.11)."""
    _, words, gauss = rng.getstate()
    return f"{hash(words) & (2**64 - 1):016x}{gauss!r}"


def rng_digests() -> dict[str, str]:
    """The global torch, CUDA, python RNG states, and numpy's once the script has loaded numpy, one
    fingerprint each."""
    states = {"rng_torch": digest(torch.get_rng_state()), "rng_python": python_rng_digest()}
    numpy = sys.modules.get("numpy")
    if numpy is not None and hasattr(numpy, "random"):  # hasattr: numpy may still be importing itself
        states["rng_numpy"] = _numpy_rng_digest(numpy)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["rng_cuda"] = digest(torch.cuda.get_rng_state_all())
    return states


def tensors_in(value, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, with a dotted path to it."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors_in(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from tensors_in(item, f"{prefix}.{index}" if prefix else str(index))


def dicts_in(value) -> Iterator[dict]:
    """Every dict inside nested dicts, lists and tuples, the outer one first."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from dicts_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from dicts_in(item)


def summary(value, limit: int = 400) -> list[dict]:
    """What a saved object holds: each tensor's path, dtype and size, at most `limit` of them."""
    rows = []
    for path, tensor in tensors_in(value):
        if len(rows) >= limit:
            break
        rows.append({"key": path, "dtype": str(tensor.dtype), "shape": list(tensor.shape)})
    return rows


def top_keys(value) -> list[str]:
    return [str(key) for key in value] if isinstance(value, dict) else [type(value).__name__]


def weight_sample(params: Iterable[torch.Tensor], size: int = 4096) -> torch.Tensor:
    """About `size` values spread evenly over the (largest) parameters, as a contiguous float32 CPU tensor:
    the weight-distance probe."""
    params = list(params)
    if len(params) > 8:  # the eight largest, in their order: a step of a small model is mostly this sample's ops
        largest = set(sorted(range(len(params)), key=lambda i: -params[i].numel())[:8])
        params = [p for i, p in enumerate(params) if i in largest]
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    stride = max(1, sum(p.numel() for p in params) // size)
    with torch.no_grad():  # views of the parameters, not nodes of the autograd graph: a few microseconds each
        sample = torch.cat([p.reshape(-1) if stride == 1 else p.reshape(-1)[::stride] for p in params])
    return (sample if sample.dtype == torch.float32 else sample.float()).cpu().contiguous()
