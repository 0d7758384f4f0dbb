"""A state kept inside a framework's own checkpoint dict, sealed: its torch.save bytes and their xxh3-128
(with a key, their HMAC: store/seal_hash.py), verified before a byte is unpickled (weights_only=True),
as our files are."""

from __future__ import annotations

import io

import torch

from exactresume.errors import CheckpointError
from exactresume.store.seal_hash import KEYED_PREFIX, UNKEYED_PREFIX, mismatch, refuse_other_sealing, sealing

KIND = "exactresume-sealed-state"
DIGEST_FIELDS = {UNKEYED_PREFIX: "xxh3_128", KEYED_PREFIX: "hmac_128"}


def sealed(state: object) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return {"kind": KIND, DIGEST_FIELDS[sealing().prefix]: sealing().of(payload), "payload": payload}


def opened(entry: object, where: str) -> object:
    """The state `sealed` kept; a CheckpointError naming `where` when it is not ours or not intact."""
    if not isinstance(entry, dict) or entry.get("kind") != KIND:
        raise CheckpointError(f"{where} does not hold a sealed exactresume state")
    payload = entry.get("payload")
    prefix = next((prefix for prefix, field in DIGEST_FIELDS.items() if field in entry), None)
    if not isinstance(payload, bytes) or prefix is None:
        raise CheckpointError(f"{where}: the exactresume state is damaged (no payload, or no checksum)")
    refuse_other_sealing(where, prefix)
    if not sealing().matches(sealing().of(payload), entry[DIGEST_FIELDS[prefix]]):
        raise mismatch(where)
    return torch.load(io.BytesIO(payload), weights_only=True)
