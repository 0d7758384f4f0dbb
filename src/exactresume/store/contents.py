"""What a checkpoint is and what it holds, read without running anything from it: `exactresume inspect`.

    exactresume inspect runs/lab/resume.pth           # a table for people
    exactresume inspect runs/lab/resume.pth --json    # the same facts for scripts

Kinds (told apart by formats.py, as --resume and load_model tell them): `resume` (our resume file),
`weights` (an fp32 state dict), `export` (inference weights in fp16/bf16, or any safetensors file),
`sharded` (a torch.distributed.checkpoint folder), `store` (a CheckpointStore's folder, listing.py),
`torch` (any other torch file). Every file is verified by the reader --resume and diff use (its seal;
a sharded folder's commit marker, every file's checksum and DCP's index held to the files), and a
damaged one is one line and exit code 2, whatever the command; what cannot be verified is shown as
such: `checksum` says `absent` for a file without a seal (MiniMind's own), and a DCP folder without
our commit marker has `commit` `missing` (the save did not finish, or DCP wrote it without us; a
resume refuses it). For each part (a resume file's top-level key, a sharded folder's first name
component, `model` for weights) it counts the tensors and the elements and bytes the file stores: a
storage two names share (the tied lm_head) is counted once, as the file holds it once.

A resume file is described by the state torch.load gives back (versions 1 and 3 share one layout).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from exactresume.errors import CheckpointError
from exactresume.store.formats import RESUME_FORMAT, RESUME_VERSIONS, check_format, content_kind, path_kind
from exactresume.store.listing import format_listing, format_tiers, list_checkpoints, list_tiers
from exactresume.store.locations import Location, S3Location
from exactresume.store.resume import RESERVED_NAMES, read_resume_file, saved_step, tensors_in
from exactresume.store.safetensors_weights import DIGEST_KEY, KEYED_DIGEST_KEY, load_verified, tied_names
from exactresume.store.seal_hash import sealing
from exactresume.store.sealed import load_sealed, read_seal

SHARDED_KEYS = ("commit", "commit_problem", "processes")  # a sharded folder's report only
SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _empty_summary() -> dict:
    return {"tensors": 0, "shared": 0, "elements": 0, "bytes": 0, "dtypes": {}}


def _add(summary: dict, dtype: str, elements: int, nbytes: int) -> None:
    summary["elements"] += elements
    summary["bytes"] += nbytes
    summary["dtypes"][dtype] = summary["dtypes"].get(dtype, 0) + nbytes


def summarize(obj: Any, min_dim: int = 0) -> dict:
    """tensors, shared (names whose storage an earlier one holds), elements, bytes, dtypes {dtype: bytes}."""
    seen: set[tuple[int, int]] = set()
    summary = _empty_summary()
    for tensor in tensors_in(obj):
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


def _weights_kind(state_dict: dict) -> str:
    floating = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    return "weights" if floating <= {torch.float32} else "export"


def _describe_torch(obj: Any) -> dict:
    kind = content_kind(obj)
    if kind == "resume":
        parts = {name: summarize(value) for name, value in obj.items() if name not in RESERVED_NAMES}
        model = obj.get("model") if isinstance(obj.get("model"), dict) else {}
        return {
            "kind": "resume",
            "format": RESUME_FORMAT,
            "version": obj.get("version"),
            "step": saved_step(obj),
            "config": obj.get("config"),
            "parts": parts,
            "tied": tied_names(model),
        }
    if kind == "weights":
        return {"kind": _weights_kind(obj), "parts": {"model": summarize(obj)}, "tied": tied_names(obj)}
    parts = {str(k): summarize(v) for k, v in obj.items()} if isinstance(obj, dict) else {"(root)": summarize(obj)}
    return {"kind": "torch", "parts": parts, "keys": list(parts)}


def _inspect_torch_file(path: Path) -> dict:
    sealed = read_seal(path) is not None
    obj = load_sealed(path, require_seal=sealed)  # a sealed file's bytes are verified before it is read
    if content_kind(obj) == "resume":  # a version this release cannot resume is refused as --resume refuses it
        check_format(path, obj, RESUME_FORMAT, RESUME_VERSIONS, "a resume file")
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
        "checksum": "verified" if {DIGEST_KEY, KEYED_DIGEST_KEY} & metadata.keys() else "absent",
    }


def _commit(folder: Path) -> dict:
    """The commit marker verified as --resume verifies it: every file present with its checksum. A
    folder without one is shown as not trusted; a damaged one is refused, as --resume refuses it."""
    from exactresume.store.sharded import COMMIT, SHARDED_FORMAT, verify_sharded

    try:
        marker = verify_sharded(folder)
    except CheckpointError as error:
        if os.path.lexists(folder / COMMIT):
            raise
        return {"commit": "missing", "commit_problem": str(error), "checksum": "absent"}
    return {
        "commit": "verified",
        "checksum": "verified",
        "format": SHARDED_FORMAT,
        "version": marker["version"],
        "processes": marker["processes"],
        "step": marker.get("step"),
        "files_listed": marker["files"],
    }


def _inspect_sharded(folder: Path) -> dict:
    """Sizes from DCP's index (tensors by dtype and shape, pickled objects by stored length), and the commit."""
    from exactresume.store.dcp_index import check_index, read_metadata

    commit = _commit(folder)
    metadata = read_metadata(folder)
    if commit["commit"] == "verified":  # held to the folder's files as a load holds it
        check_index(folder, metadata, commit.pop("files_listed"))
    stored: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    parts: dict[str, dict] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.split(".")[0] in RESERVED_NAMES:  # our own keys beside the parts
            continue
        part = parts.setdefault(fqn.split(".")[0], _empty_summary())
        properties = getattr(entry, "properties", None)
        if properties is None:  # BytesStorageMetadata: a pickled Python object
            _add(part, "pickled", 0, stored.get(fqn, 0))
            continue
        part["tensors"] += 1
        elements = math.prod(entry.size)
        nbytes = elements * torch.empty(0, dtype=properties.dtype).element_size()
        _add(part, str(properties.dtype).removeprefix("torch."), elements, nbytes)
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {
        "kind": "sharded",
        "container": "torch.distributed.checkpoint",
        "format": "torch.distributed.checkpoint",
        "version": metadata.version,
        "parts": parts,
        "files": len(files),
        "file_bytes": sum(p.stat().st_size for p in files),
    } | commit


def _description(info: dict) -> str:
    dtypes = [SHORT_DTYPES.get(d, d) for d in info["total"]["dtypes"] if d in SHORT_DTYPES]
    if info["kind"] == "resume":
        steps = ((info.get("config") or {}).get("train") or {}).get("steps")
        return f"resume file ({info['format']} version {info['version']}), step {info['step']}" + (
            f" of {steps}" if steps is not None else ""
        )
    if info["kind"] == "weights":
        return "fp32 weights file"
    if info["kind"] == "export":
        return f"{'/'.join(dtypes) or 'non-float'} inference weights ({info['container']} export)"
    if info["kind"] == "sharded" and info["commit"] == "verified":
        processes = f"{info['processes']} process" + ("es" if info["processes"] != 1 else "")
        step = f", step {info['step']}" if info.get("step") is not None else ""
        return f"sharded resume folder ({info['format']} version {info['version']}, {processes}){step}"
    if info["kind"] == "sharded":
        return f"sharded checkpoint folder (torch.distributed.checkpoint), {info['commit']} commit marker: not trusted"
    return f"torch file, not an exactresume layout (keys: {', '.join(info['keys'][:8])})"


def inspect_checkpoint(path: Location) -> dict:
    """Everything `inspect` reports about `path` (a path or an `s3://` location), as plain JSON-ready values."""
    if isinstance(path, S3Location):
        return _inspect_s3(path)
    path = Path(path)
    kind = path_kind(path)
    if kind == "missing":
        raise CheckpointError(f"cannot read {path}: No such file or directory")
    if kind == "folder":
        return list_checkpoints(path, summarize)
    if kind == "sharded":
        info = _inspect_sharded(path)
    else:
        info = _inspect_safetensors(path) if kind == "safetensors" else _inspect_torch_file(path)
        info |= {"files": 1, "file_bytes": path.stat().st_size}
    info["total"] = _total(info["parts"])
    ordered = {"path": str(path), "kind": info["kind"], "description": ""}
    for key in ("container", "format", "version", "step", "config", "checksum", "files", "file_bytes"):
        ordered[key] = info.get(key)
    for key in SHARDED_KEYS if kind == "sharded" else ():
        ordered[key] = info.get(key)
    ordered |= {"parts": info["parts"], "total": info["total"], "tied": info.get("tied", {})}
    ordered["description"] = _description(info)
    return ordered


def inspect_tiers(durable: Location, local: Path) -> dict:
    """What `inspect FOLDER --local-checkpoints DIR` reports: both tiers of a run (listing.py)."""
    return list_tiers(durable, local, summarize)


def _inspect_s3(target: S3Location) -> dict:
    """A store prefix listed, or a committed file or sharded folder inspected in its verified local copy."""
    from exactresume.store.s3.kinds import local_copy, s3_kind

    if s3_kind(target) == "folder":
        return list_checkpoints(target, summarize)
    with local_copy(target) as local:
        try:
            info = inspect_checkpoint(local)
        except CheckpointError as error:
            raise type(error)(str(error).replace(str(local), str(target))) from None
    return info | {"path": str(target)}


def resume_size_breakdown(path: Path) -> dict:
    """A resume file's bytes split into fp32 weights, optimizer moments (tensors of 1+ dims) and the rest."""
    state = read_resume_file(Path(path))
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
    "mismatch": "recorded, but the files do not match it",
}
# A resume file as exactresume never writes one: inspect shows it, and says that --resume refuses it.
UNSEALED_RESUME_TEXT = "none recorded, yet exactresume seals every resume file it writes; --resume refuses it"
COMMIT_TEXT = {
    "verified": "commit.pth lists every file with its checksum, all match",
    "missing": "no commit.pth: the save did not finish (or was not made by exactresume); --resume refuses it",
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
    if info["kind"] == "store":
        return format_listing(info)
    if info["kind"] == "tiers":
        return format_tiers(info)
    unsealed_resume = info["kind"] == "resume" and info["checksum"] == "absent"
    checksum = UNSEALED_RESUME_TEXT if unsealed_resume else CHECKSUM_TEXT[info["checksum"]]
    if info["checksum"] == "verified" and sealing().key is not None:
        checksum = "a keyed seal (HMAC-SHA-256) recorded in the file, bytes match it with the key set"
    lines = [f"{info['path']}: {info['description']}", f"  checksum   {checksum}"]
    if info.get("commit"):
        lines.append(f"  commit     {info['commit']}: {COMMIT_TEXT[info['commit']].format(**info)}")
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
