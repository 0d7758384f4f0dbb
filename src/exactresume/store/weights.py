"""Weights files (model state dicts for inference or comparison): write them, read any of ours.

`read_weights` accepts a weights file or a resume file, sealed by us or plain (MiniMind's own
`.pth` files), a safetensors file (`exactresume export`) or a sharded resume folder (`--sharded`), in
fp32, fp16 or bf16, and returns the state dict with the config when the file records one. Building a
model from a file is the training layer's (training/inference.py `load_model`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from exactresume.config import ModelConfig
from exactresume.errors import CheckpointError
from exactresume.store.formats import content_kind, path_kind
from exactresume.store.locations import Location, S3Location
from exactresume.store.resume import check_resume_state
from exactresume.store.safetensors_weights import read_safetensors
from exactresume.store.sealed import load_sealed, save_sealed

StateDict = dict[str, torch.Tensor]


def save_weights(path: Path, state_dict: StateDict) -> None:
    """Write a plain state dict atomically, with its checksum (tied tensors stay one storage)."""
    save_sealed(Path(path), dict(state_dict))


def read_weights(path: Location) -> tuple[StateDict, ModelConfig | None]:
    """The model state dict held by `path` (or a committed `s3://` one), and its ModelConfig when recorded."""
    if isinstance(path, S3Location):
        from exactresume.store.s3_kinds import local_copy

        with local_copy(path) as local:
            try:
                return read_weights(local)
            except CheckpointError as error:
                raise CheckpointError(str(error).replace(str(local), str(path))) from None
    path = Path(path)
    kind, config = path_kind(path), None
    if kind == "sharded":  # a sharded resume checkpoint (--sharded)
        from exactresume.store.sharded import load_sharded

        state = load_sharded(path)
        return state["model"], ModelConfig.from_dict(state["config"]["model"])
    if kind == "safetensors":
        obj, config = read_safetensors(path)
    else:
        obj = load_sealed(path, require_seal=False)
    if content_kind(obj) == "resume":
        state = check_resume_state(path, obj)
        return state["model"], ModelConfig.from_dict(state["config"]["model"])
    if content_kind(obj) == "weights":
        return obj, config
    raise CheckpointError(f"{path} holds no MiniMind model weights")
