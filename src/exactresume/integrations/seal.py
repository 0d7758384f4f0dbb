"""A state kept inside a framework's own checkpoint dict, sealed: its torch.save bytes and their xxh3-128,
verified before a byte is unpickled (weights_only=True), as our files are."""

from __future__ import annotations

import io

import torch
import xxhash

from exactresume.errors import CheckpointError

KIND = "exactresume-sealed-state"


def sealed(state: object) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return {"kind": KIND, "xxh3_128": xxhash.xxh3_128_hexdigest(payload), "payload": payload}


def opened(entry: object, where: str) -> object:
    """The state `sealed` kept; a CheckpointError naming `where` when it is not ours or not intact."""
    if not isinstance(entry, dict) or entry.get("kind") != KIND:
        raise CheckpointError(f"{where} does not hold a sealed exactresume state")
    payload = entry.get("payload")
    if not isinstance(payload, bytes) or xxhash.xxh3_128_hexdigest(payload) != entry.get("xxh3_128"):
        raise CheckpointError(f"{where}: the exactresume state is damaged (its checksum does not match)")
    return torch.load(io.BytesIO(payload), weights_only=True)
