"""A keyed bijection of 0 .. n - 1, computed for any positions without building the whole order.

`permute(positions, n, keys)` is a balanced Feistel network on the smallest even number of bits
covering n, with a splitmix64 round function, walked in cycles until each value lands below n
(the domain is under 4n, so under four rounds of walking on average). The same (n, keys) always
gives the same order, on every machine: only uint64 arithmetic, which wraps identically.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def round_keys(seed: int) -> tuple[int, ...]:
    """ROUNDS 64-bit round keys derived from `seed`."""
    return tuple(
        int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")
        for index in range(ROUNDS)
    )


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64."""
    values = (values ^ (values >> _S30)) * _M1
    values = (values ^ (values >> _S27)) * _M2
    return values ^ (values >> _S31)


def _feistel(values: np.ndarray, keys: tuple[int, ...], half_bits: int) -> np.ndarray:
    shift, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
    left, right = values >> shift, values & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ np.uint64(key)) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, count: int, keys: tuple[int, ...]) -> np.ndarray:
    """The values at `positions` (uint64, each below `count`) of a permutation of 0 .. count - 1."""
    half_bits = max(1, ((count - 1).bit_length() + 1) // 2)
    values = _feistel(np.asarray(positions, dtype=np.uint64), keys, half_bits)
    outside = values >= count
    while outside.any():
        values[outside] = _feistel(values[outside], keys, half_bits)
        outside = values >= count
    return values
