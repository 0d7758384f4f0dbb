"""Weights files (model state dicts for inference or comparison): write them, read any of ours.

`read_weights` accepts a weights file or a resume file, sealed by us or plain (MiniMind's own
`.pth` files), a safetensors file (`exactresume export`) or a sharded resume folder (`--sharded`), in
fp32, fp16 or bf16, and returns the state dict with the config when the file records one. Building a
model from a file is the training layer's (training/inference.py `load_model`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from exactresume.config import ModelConfig
from exactresume.errors import CheckpointError
from exactresume.store.formats import content_kind, path_kind
from exactresume.store.locations import Location, S3Location
from exactresume.store.resume import RESERVED_NAMES, check_resume_state
from exactresume.store.safetensors_weights import read_safetensors
from exactresume.store.sealed import load_sealed, save_sealed

StateDict = dict[str, torch.Tensor]


def save_weights(path: Path, state_dict: StateDict) -> None:
    """Write a plain state dict atomically, with its checksum (tied tensors stay one storage)."""
    save_sealed(Path(path), dict(state_dict))


def read_weights(path: Location) -> tuple[StateDict, ModelConfig | None]:
    """The model state dict held by `path` (or a committed `s3://` one), and its ModelConfig when recorded."""
    if isinstance(path, S3Location):
        from exactresume.store.s3.kinds import local_copy

        with local_copy(path) as local:
            try:
                return read_weights(local)
            except CheckpointError as error:
                raise type(error)(str(error).replace(str(local), str(path))) from None
    path = Path(path)
    kind, config = path_kind(path), None
    if kind == "folder":  # a CheckpointStore's folder: its newest checkpoint that verifies, as a resume reads it
        return _resume_weights(_newest_checkpoint(path))
    if kind == "sharded":  # a sharded resume checkpoint (--sharded)
        from exactresume.store.sharded import load_sharded

        return _resume_weights(load_sharded(path))
    if kind == "safetensors":
        obj, config = read_safetensors(path)
    else:
        obj = load_sealed(path, require_seal=False)
    if content_kind(obj) == "resume":
        return _resume_weights(check_resume_state(path, obj))
    if content_kind(obj) == "weights" or _is_module_state(obj):  # ours, or any model's torch.save(state_dict())
        return obj, config
    raise CheckpointError(f"{path} holds no model weights (a resume file, or a module's state dict)")


def _newest_checkpoint(folder: Path) -> dict:
    """The newest checkpoint that verifies of a store's folder: one-file ones, or sharded ones (`step-*.dcp`,
    read whole) where the folder holds only those."""
    from exactresume.store.layout import ONE_FILE, SHARDED
    from exactresume.store.numbered import CheckpointStore
    from exactresume.world import World

    names = [path.name for path in folder.iterdir()]

    def holds(layout) -> bool:
        return any(layout.step_of(name) is not None for name in names)

    sharded = holds(SHARDED) and not holds(ONE_FILE)
    store = CheckpointStore(folder, keep=None, sharded=sharded, world=World())  # read here, in one process
    found = store.load_newest()  # each one passed over is named on stderr
    if found is None:
        raise CheckpointError(
            f"{folder} holds no checkpoint that verifies ({'step-*.dcp' if sharded else 'step-*.pth'})"
        )
    return found[1]


def _resume_weights(state: dict) -> tuple[StateDict, ModelConfig | None]:
    """A resume state's weights and model config: its `model` part when that is its only module's state
    dict; else the tensors of every part that is one (an EMA copy, a teacher, a part named otherwise)
    under their dotted paths (`ema.0.weight`), or of every part when none is."""
    config = (state.get("config") or {}).get("model") if isinstance(state.get("config"), dict) else None
    model_config = ModelConfig.from_dict(config) if isinstance(config, dict) else None
    parts = {name: value for name, value in state.items() if name not in RESERVED_NAMES}
    modules = {name: value for name, value in parts.items() if _is_module_state(value)}
    if list(modules) == ["model"]:  # the trainer's file, and most loops': the names as the model has them
        return modules["model"], model_config
    return dict(_tensor_leaves(modules or parts)), None


def _is_module_state(value: object) -> bool:
    """A flat name -> tensor dict, as a module's state_dict is (an optimizer's or an RNG's is not)."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _tensor_leaves(value: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) for every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensor_leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensor_leaves(item, f"{path}.{index}" if path else str(index))
