"""What a checkpoint is and what it holds, read without running anything from it: `exactresume inspect`.

    exactresume inspect runs/lab/resume.pth           # a table for people
    exactresume inspect runs/lab/resume.pth --json    # the same facts for scripts

Kinds: `resume` (our resume file), `weights` (an fp32 state dict), `export` (inference weights in
fp16/bf16, or any safetensors file), `sharded` (a torch.distributed.checkpoint folder, recognised
by its `.metadata` file and read best-effort), `torch` (any other torch file). For each part (a
resume file's top-level key, a sharded folder's first name component, `model` for weights) it
counts the tensors and the elements and bytes the file stores: a storage two names share (the tied
lm_head) is counted once, as the file holds it once. A damaged file is one line and exit code 2.
"""

from __future__ import annotations

import importlib
import json
import math
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from exactresume.errors import CheckpointError
from exactresume.store.resume import RESUME_FORMAT, load_resume
from exactresume.store.safetensors_weights import DIGEST_KEY, is_safetensors, load_verified, tied_names
from exactresume.store.sealed import load_sealed, read_seal

MODEL_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# What a torch.distributed.checkpoint `.metadata` pickle may name; anything else is refused unread.
DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def _empty_summary() -> dict:
    return {"tensors": 0, "shared": 0, "elements": 0, "bytes": 0, "dtypes": {}}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _add(summary: dict, dtype: str, elements: int, nbytes: int) -> None:
    summary["elements"] += elements
    summary["bytes"] += nbytes
    summary["dtypes"][dtype] = summary["dtypes"].get(dtype, 0) + nbytes


def summarize(obj: Any, min_dim: int = 0) -> dict:
    """tensors, shared (names whose storage an earlier one holds), elements, bytes, dtypes {dtype: bytes}."""
    seen: set[tuple[int, int]] = set()
    summary = _empty_summary()
    for tensor in _tensors(obj):
        if tensor.dim() < min_dim:
            continue
        summary["tensors"] += 1
        storage = tensor.untyped_storage()
        identity = (storage.data_ptr(), storage.nbytes())
        if identity in seen and storage.nbytes():
            summary["shared"] += 1
            continue
        seen.add(identity)
        _add(
            summary,
            str(tensor.dtype).removeprefix("torch."),
            storage.nbytes() // tensor.element_size(),
            storage.nbytes(),
        )
    return summary


def _total(parts: dict[str, dict]) -> dict:
    total = _empty_summary()
    for part in parts.values():
        total["tensors"] += part["tensors"]
        total["shared"] += part["shared"]
        for dtype, nbytes in part["dtypes"].items():
            total["dtypes"][dtype] = total["dtypes"].get(dtype, 0) + nbytes
        total["elements"] += part["elements"]
        total["bytes"] += part["bytes"]
    return total


def _is_model_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(v, torch.Tensor) for v in obj.values())
        and any(key in obj for key in MODEL_KEYS)
    )


def _weights_kind(state_dict: dict) -> str:
    floating = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    return "weights" if floating <= {torch.float32} else "export"


def _describe_torch(obj: Any) -> dict:
    if isinstance(obj, dict) and obj.get("format") == RESUME_FORMAT:
        parts = {name: summarize(value) for name, value in obj.items() if name not in ("format", "version")}
        model = obj.get("model") if isinstance(obj.get("model"), dict) else {}
        return {
            "kind": "resume",
            "format": RESUME_FORMAT,
            "version": obj.get("version"),
            "step": obj.get("step"),
            "config": obj.get("config"),
            "parts": parts,
            "tied": tied_names(model),
        }
    if _is_model_state_dict(obj):
        return {"kind": _weights_kind(obj), "parts": {"model": summarize(obj)}, "tied": tied_names(obj)}
    parts = {str(k): summarize(v) for k, v in obj.items()} if isinstance(obj, dict) else {"(root)": summarize(obj)}
    return {"kind": "torch", "parts": parts, "keys": list(parts)}


def _inspect_torch_file(path: Path) -> dict:
    sealed = read_seal(path) is not None
    obj = load_sealed(path, require_seal=sealed)  # a sealed file's bytes are verified before it is read
    return _describe_torch(obj) | {"container": "torch", "checksum": "verified" if sealed else "absent"}


def _inspect_safetensors(path: Path) -> dict:
    tensors, metadata = load_verified(path)
    try:
        config = json.loads(metadata["config"]) if "config" in metadata else None
        tied = json.loads(metadata.get("tied", "{}"))
    except ValueError:
        raise CheckpointError(f"{path}: unreadable exactresume metadata in the safetensors header") from None
    version = metadata.get("version", "")
    return {
        "kind": "export",
        "container": "safetensors",
        "format": metadata.get("format"),
        "version": int(version) if version.isdigit() else None,
        "config": {"model": config} if config else None,
        "parts": {"model": summarize(tensors)},
        "tied": tied,
        "checksum": "verified" if DIGEST_KEY in metadata else "absent",
    }


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Reads a `.metadata` pickle naming only DCP's metadata classes, torch dtypes and torch.Size."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (dtype or name in DCP_CLASSES.get(module, ())):
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not read")
        importlib.import_module(module)  # DCP's classes live in modules `import torch` does not load
        return super().find_class(module, name)


def _read_dcp_metadata(folder: Path) -> Any:
    try:
        with open(folder / ".metadata", "rb") as file:
            metadata = _DcpMetadataUnpickler(file).load()
        metadata.state_dict_metadata  # noqa: B018  (a pickle of something else fails here)
        return metadata
    except Exception as error:  # unpickling raises many types; all mean the same thing here
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"{folder}/.metadata is not readable torch.distributed.checkpoint metadata ({reason[:160]})"
        ) from None


def _inspect_sharded(folder: Path) -> dict:
    """Best effort: sizes from DCP's metadata (tensors by dtype and shape, pickled objects by stored length)."""
    metadata = _read_dcp_metadata(folder)
    stored: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(info, "length", 0))
    parts: dict[str, dict] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        part = parts.setdefault(fqn.split(".")[0], _empty_summary())
        properties = getattr(entry, "properties", None)
        if properties is None:  # BytesStorageMetadata: a pickled Python object
            _add(part, "pickled", 0, stored.get(fqn, 0))
            continue
        part["tensors"] += 1
        elements = math.prod(entry.size)
        _add(
            part,
            str(properties.dtype).removeprefix("torch."),
            elements,
            elements * torch.empty(0, dtype=properties.dtype).element_size(),
        )
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {
        "kind": "sharded",
        "container": "torch.distributed.checkpoint",
        "format": "torch.distributed.checkpoint",
        "version": getattr(metadata, "version", None),
        "parts": parts,
        "checksum": "absent",
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
    }


def _description(info: dict) -> str:
    dtypes = [SHORT_DTYPES.get(d, d) for d in info["total"]["dtypes"] if d in SHORT_DTYPES]
    if info["kind"] == "resume":
        steps = ((info.get("config") or {}).get("train") or {}).get("steps", "?")
        return f"resume file ({info['format']} version {info['version']}), step {info['step']} of {steps}"
    if info["kind"] == "weights":
        return "fp32 weights file"
    if info["kind"] == "export":
        return f"{'/'.join(dtypes) or 'non-float'} inference weights ({info['container']} export)"
    if info["kind"] == "sharded":
        return f"sharded checkpoint folder (torch.distributed.checkpoint, {info['files']} files; best-effort)"
    return f"torch file, not an exactresume layout (keys: {', '.join(info['keys'][:8])})"


def inspect_checkpoint(path: Path) -> dict:
    """Everything `inspect` reports about `path`, as plain JSON-ready values."""
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is a folder without a .metadata file, not a sharded checkpoint")
        info = _inspect_sharded(path)
    elif not path.exists():
        raise CheckpointError(f"cannot read {path}: No such file or directory")
    else:
        info = _inspect_safetensors(path) if is_safetensors(path) else _inspect_torch_file(path)
        info |= {"files": 1, "file_bytes": path.stat().st_size}
    info["total"] = _total(info["parts"])
    ordered = {"path": str(path), "kind": info["kind"], "description": ""}
    for key in (
        "container",
        "format",
        "version",
        "step",
        "config",
        "checksum",
        "files",
        "file_bytes",
        "parts",
        "total",
    ):
        ordered[key] = info.get(key)
    ordered["tied"] = info.get("tied", {})
    ordered["description"] = _description(info)
    return ordered


def resume_size_breakdown(path: Path) -> dict:
    """A resume file's bytes split into fp32 weights, optimizer moments (tensors of 1+ dims) and the rest."""
    state = load_resume(Path(path))
    weights = summarize(state["model"])["bytes"]
    moments = summarize(state["optimizer"], min_dim=1)["bytes"]
    file_bytes = Path(path).stat().st_size
    return {
        "file_bytes": file_bytes,
        "weights_bytes": weights,
        "optimizer_moments_bytes": moments,
        "rest_bytes": file_bytes - weights - moments,
    }


CHECKSUM_TEXT = {
    "verified": "xxh3-128 recorded in the file, bytes match",
    "absent": "none recorded (nothing to verify)",
}


def _share(part: int, whole: int) -> str:
    percent = 100 * part / whole
    return "<1%" if 0 < percent < 1 else f"{percent:.0f}%"


def _dtype_mix(dtypes: dict[str, int]) -> str:
    total = sum(dtypes.values())
    return ", ".join(f"{dtype} {_share(nbytes, total)}" for dtype, nbytes in dtypes.items()) if total else "-"


def _config_lines(config: dict | None) -> list[str]:
    lines = []
    for section, values in (config or {}).items():
        text = ", ".join(f"{k} {v}" for k, v in values.items()) if isinstance(values, dict) else str(values)
        lines.append(f"  {section:<10} {text}")
    return lines


def format_inspection(info: dict) -> str:
    """The human view of `inspect_checkpoint`'s result: header lines, then one row per part."""
    lines = [f"{info['path']}: {info['description']}", f"  checksum   {CHECKSUM_TEXT[info['checksum']]}"]
    lines += _config_lines(info["config"])
    files = f" in {info['files']} files" if info["files"] != 1 else ""
    lines.append(f"  size       {info['file_bytes']:,} bytes{files}")
    lines.append(f"  {'part':<12}{'tensors':>9}{'elements':>14}{'bytes':>14}  dtypes (share of bytes)")
    for name, part in list(info["parts"].items()) + [("total", info["total"])]:
        shared = f" (+{part['shared']} shared)" if part["shared"] else ""
        lines.append(
            f"  {name:<12}{part['tensors']:>9,}{part['elements']:>14,}{part['bytes']:>14,}  "
            f"{_dtype_mix(part['dtypes'])}{shared}"
        )
    lines.append(
        f"  {'other bytes':<12}{'':>23}{info['file_bytes'] - info['total']['bytes']:>14,}  "
        "names, structure, non-tensor values"
    )
    lines += [f"  tied       {name} = {source} (stored once)" for name, source in info["tied"].items()]
    return "\n".join(lines)
