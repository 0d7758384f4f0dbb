"""Inference weights as a safetensors file: each tensor stored once, config and checksum in its header.

safetensors refuses two names sharing one storage, so a tied matrix (MiniMind's `lm_head.weight` is
`model.embed_tokens.weight`) is stored under its first name only and the header's metadata records
the tie; `read_safetensors` hands back both names, one tensor. The metadata (strings only) also
holds the ModelConfig as JSON and an xxh3-128 digest of every tensor's name, dtype, shape and bytes
(with a key, their HMAC: seal_hash.py), checked before the weights are returned. Loading a
safetensors file never runs code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from exactresume.atomic import atomic_write_bytes
from exactresume.config import ModelConfig
from exactresume.errors import CheckpointError, UserError
from exactresume.store.onepass import byte_view
from exactresume.store.seal_hash import KEYED_PREFIX, UNKEYED_PREFIX, mismatch, refuse_other_sealing, sealing

StateDict = dict[str, torch.Tensor]
WEIGHTS_FORMAT = "exactresume.weights"
FORMAT_VERSION = "1"
DIGEST_KEY, KEYED_DIGEST_KEY = "exactresume.xxh3_128", "exactresume.hmac_128"
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _safetensors_module():
    """safetensors itself, imported on first use: the library installs without it (it is in the lab's extra)."""
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("safetensors files need safetensors: pip install safetensors (or 'exactresume[lab]')") from None
    return safetensors


def is_safetensors(path: Path) -> bool:
    """True when the file starts like a safetensors file (8-byte header length, then a JSON object)."""
    try:
        with open(path, "rb") as file:
            head = file.read(9)
            size = file.seek(0, 2)
    except OSError:
        return False
    if len(head) < 9:
        return False
    header_length = struct.unpack("<Q", head[:8])[0]
    return head[8:9] == b"{" and header_length <= min(MAX_HEADER, size - 8)


def tied_names(state_dict: StateDict) -> dict[str, str]:
    """{later name: first name} for every tensor that shares its storage with an earlier one."""
    first_by_storage: dict[tuple, str] = {}
    tied = {}
    for name, tensor in state_dict.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if identity in first_by_storage and tensor.numel():
            tied[name] = first_by_storage[identity]
        else:
            first_by_storage.setdefault(identity, name)
    return tied


def _tensors_digest(tensors: StateDict) -> str:
    """The seal hash over each tensor's name, dtype, shape and bytes, in name order."""
    digest = sealing().hasher()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(byte_view(tensor.reshape(-1).view(torch.uint8)))
    return digest.hexdigest()


def save_safetensors(path: Path, state_dict: StateDict, config: ModelConfig | None) -> None:
    """Write `state_dict` atomically, each tied tensor once, with its config and digest in the metadata."""
    tied = tied_names(state_dict)
    tensors = {name: tensor.contiguous() for name, tensor in state_dict.items() if name not in tied}
    metadata = {
        "format": WEIGHTS_FORMAT,
        "version": FORMAT_VERSION,
        "tied": json.dumps(tied),
        (KEYED_DIGEST_KEY if sealing().key is not None else DIGEST_KEY): _tensors_digest(tensors),
    }
    if config is not None:
        metadata["config"] = json.dumps(config.to_dict())
    # Small files (inference weights): serialising to bytes first keeps the write atomic and simple.
    atomic_write_bytes(Path(path), _safetensors_module().torch.save(tensors, metadata=metadata))


def read_metadata(path: Path) -> dict[str, str]:
    """The header's `__metadata__` (strings), without reading any tensor."""
    with open(path, "rb") as file:
        header_length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(header_length))
    return header.get("__metadata__") or {}


def load_verified(path: Path) -> tuple[StateDict, dict[str, str]]:
    """The stored tensors (tied ones once) and the metadata, after checking the digest if there is one."""
    safetensors = _safetensors_module()
    try:
        metadata = read_metadata(path)
        tensors = safetensors.torch.load_file(path)
    except (OSError, ValueError, safetensors.SafetensorError) as error:
        raise CheckpointError(f"{path}: not a loadable safetensors file ({str(error)[:200]})") from None
    keyed = KEYED_DIGEST_KEY in metadata
    recorded = metadata.get(KEYED_DIGEST_KEY if keyed else DIGEST_KEY)
    if recorded is None and sealing().key is None:
        return tensors, metadata  # a safetensors file of another tool's, read as it is
    if recorded is None:
        raise CheckpointError(f"{path}: carries no exactresume digest, while a key is set: refused")
    refuse_other_sealing(path, KEYED_PREFIX if keyed else UNKEYED_PREFIX)
    if not sealing().matches(_tensors_digest(tensors), recorded):
        raise mismatch(path)
    return tensors, metadata


def read_safetensors(path: Path) -> tuple[StateDict, ModelConfig | None]:
    """The full state dict (tied names restored, sharing one tensor) and the config if recorded."""
    tensors, metadata = load_verified(path)
    try:
        for name, source in json.loads(metadata.get("tied", "{}")).items():
            tensors[name] = tensors[source]
        config = ModelConfig.from_dict(json.loads(metadata["config"])) if "config" in metadata else None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: unreadable exactresume metadata ({type(error).__name__}: {error})") from None
    return tensors, config
