"""xxh3 fingerprints of tensors, nested containers and RNG states, and short summaries of saved objects."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import xxhash

HALF_DTYPES = ("torch.float16", "torch.bfloat16")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor's values (copied to the CPU and made contiguous when needed)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


def update(hasher: xxhash.xxh3_64, value) -> None:
    """Feed one value into `hasher`: tensors by dtype, shape and bytes; containers element by element."""
    if isinstance(value, torch.Tensor):
        hasher.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if value.numel():
            hasher.update(tensor_bytes(value))
    elif isinstance(value, np.ndarray):
        hasher.update(f"A{value.dtype}{value.shape}".encode())
        hasher.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in value:
            hasher.update(repr(key).encode())
            update(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, list | tuple):
        hasher.update(b"[")
        for item in value:
            update(hasher, item)
        hasher.update(b"]")
    else:
        hasher.update(repr(value).encode())


def digest(*values) -> str:
    hasher = xxhash.xxh3_64()
    for value in values:
        update(hasher, value)
    return hasher.hexdigest()


def rng_digests() -> dict[str, str]:
    """The global torch, CUDA, numpy and python RNG states, one fingerprint each."""
    states = {
        "rng_torch": digest(torch.get_rng_state()),
        "rng_numpy": digest(list(np.random.get_state())),
        "rng_python": digest(random.getstate()),
    }
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


def weight_sample(params: Iterable[torch.Tensor], size: int = 4096) -> np.ndarray:
    """About `size` values spread evenly over all parameters, as float32: the weight-distance probe."""
    params = list(params)
    total = sum(p.numel() for p in params)
    stride = max(1, total // size)
    parts = [p.detach().reshape(-1)[::stride].float().cpu() for p in params]
    return torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)
