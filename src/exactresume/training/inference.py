"""Weights for inference: any of our files loaded as a model, and `exactresume export`.

    model = load_model("runs/lab/resume.pth")   # weights or resume file, ours or MiniMind's: an fp32 model
    exactresume export runs/lab/resume.pth --dtype fp16 --format safetensors -o model.safetensors

Only the model's weights leave: no optimizer, step or generator state (those are for resuming,
and stay exact in the resume file). A tied matrix is converted once, so the tie survives: a `.pt`
keeps both names on one storage, a safetensors file stores it once and records the tie. fp16 holds
at most 65504; a larger value would become inf, so the export is refused unless `--clamp` saturates
such values. It reports the size against the source file and, when the data folder has val.npy,
the largest logit difference between the source and the exported weights on its first 128 tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exactresume.atomic import ensure_writable_folder
from exactresume.core.model import MiniMindLM, model_from_state_dict
from exactresume.errors import UserError
from exactresume.store.safetensors_weights import save_safetensors
from exactresume.store.sealed import ZIP_START, first_bytes
from exactresume.store.weights import read_weights, save_weights
from exactresume.training.outputs import named_as_a_checkpoint, within

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = ("pt", "safetensors")
FP16_MAX = torch.finfo(torch.float16).max  # 65504.0
CHECK_TOKENS = 128  # the lab's fp16 check uses the first 128 tokens of val.npy too

StateDict = dict[str, torch.Tensor]


def load_model(path: str | Path) -> MiniMindLM:
    """Load a weights file or a resume file (fp32, fp16 or bf16) as an fp32 model in eval mode."""
    state_dict, config = read_weights(Path(path))
    return model_from_state_dict(state_dict, config)


@dataclass(frozen=True)
class ExportConfig:
    """What to export, to where, in which dtype and container."""

    source: Path  # a resume file or a weights file (any format read_weights reads)
    out: Path
    dtype: str = "fp16"  # a key of DTYPES
    format: str = "pt"  # "pt" (a torch state dict, MiniMind's own format) or "safetensors"
    clamp: bool = False  # saturate values beyond fp16's range instead of refusing
    data: Path | None = None  # folder with val.npy for the logit check; None skips it
    overwrite: bool = False  # a file already at `out` may be replaced (a folder never)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        if self.format not in FORMATS:
            raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {self.format}")
        if Path(self.out).resolve() == Path(self.source).resolve():
            raise UserError(f"-o {self.out} would overwrite the file being exported")
        self._check_out()

    def _check_out(self) -> None:
        """OUT takes no place a store or the corpus holds, whatever the flags; an earlier export's only when told."""
        if Path(self.out).is_dir():
            raise UserError(f"-o {self.out} is a folder: give the file to write")
        if named_as_a_checkpoint(self.out):
            raise UserError(f"-o {self.out} is named as a store names its checkpoints: give the file another name")
        prepared = ("manifest.json", "val.npy")  # a corpus's folder, not any folder given as --data
        corpus = self.data is not None and any((Path(self.data) / name).exists() for name in prepared)
        if corpus and within(self.out, self.data):
            raise UserError(f"-o {self.out} is in the --data folder {self.data}: give the file another place")
        if not os.path.lexists(self.out):
            return
        if not self.overwrite:
            raise UserError(f"-o {self.out} exists: give another path, or --overwrite to replace it")
        if not _an_export(Path(self.out), self.format):
            raise UserError(
                f"-o {self.out} is not a {self.format} file (it begins {first_bytes(Path(self.out), 16)!r}): an "
                "export writes over an earlier export, never over a file of another kind; give another path"
            )


def _an_export(path: Path, format: str) -> bool:
    """Whether `path` holds what an export of `format` writes: a torch file, or a safetensors one (its header's
    length, then its JSON)."""
    head = first_bytes(path, 9)
    return head.startswith(ZIP_START) if format == "pt" else len(head) == 9 and head[8:9] == b"{"


def format_for(out: Path) -> str:
    """The container an output name asks for: `.safetensors` or else a torch file."""
    return "safetensors" if Path(out).suffix == ".safetensors" else "pt"


def _check_fp16_range(state: StateDict, clamp: bool) -> int:
    """How many values lie beyond ±65504; a UserError naming the worst tensor unless `clamp`."""
    over = {name: int((t.abs() > FP16_MAX).sum()) for name, t in state.items() if t.is_floating_point()}
    count = sum(over.values())
    if count and not clamp:
        worst = max((name for name in over if over[name]), key=lambda name: state[name].abs().max().item())
        raise UserError(
            f"{count} values in {sum(1 for n in over.values() if n)} tensors exceed fp16's range ±65504 "
            f"(|x| up to {state[worst].abs().max().item():.6g} in {worst}); "
            "export as --dtype bf16, or pass --clamp to saturate them"
        )
    return count


def convert(state: StateDict, dtype: torch.dtype, clamp: bool) -> StateDict:
    """Floating tensors cast to `dtype` (clamped to fp16's range if asked), each shared storage once."""
    converted: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if identity not in converted:
            value = tensor
            if tensor.is_floating_point():
                value = tensor.clamp(-FP16_MAX, FP16_MAX) if clamp and dtype == torch.float16 else tensor
                value = value.to(dtype)
            converted[identity] = value.contiguous()
        out[name] = converted[identity]
    return out


def max_logit_difference(source: StateDict, config, exported: Path, data: Path | None) -> tuple[float | None, str]:
    """max |logits(source) - logits(exported)| on val.npy's first tokens, or None and why not."""
    val = data / "val.npy" if data is not None else None
    if val is None or not val.is_file():
        return None, f"no val.npy in {data}: logit check skipped (pass --data FOLDER)"
    tokens = np.load(val)[:CHECK_TOKENS].astype(np.int64)
    reference = model_from_state_dict(source, config)
    if tokens.size == 0 or tokens.max() >= reference.config.vocab_size:
        return None, f"{val} does not fit this model's vocabulary: logit check skipped"
    inputs = torch.from_numpy(tokens)[None, :]
    with torch.no_grad():
        difference = (reference(inputs) - load_model(exported)(inputs)).abs().max().item()
    return difference, f"on the first {inputs.shape[1]} tokens of {val}"


def export_weights(config: ExportConfig) -> dict:
    """Write the export; its sizes, clamped count and logit difference (None when skipped) with a note."""
    ensure_writable_folder(Path(config.out).parent)
    state, model_config = read_weights(config.source)
    dtype = DTYPES[config.dtype]
    clamped = _check_fp16_range(state, config.clamp) if dtype == torch.float16 else 0
    exported = convert(state, dtype, config.clamp)
    if config.format == "safetensors":
        save_safetensors(config.out, exported, model_config)
    else:
        save_weights(config.out, exported)
    difference, note = max_logit_difference(state, model_config, Path(config.out), config.data)
    source_bytes, out_bytes = Path(config.source).stat().st_size, Path(config.out).stat().st_size
    return {
        "out": str(config.out),
        "bytes": out_bytes,
        "source_bytes": source_bytes,
        "size_ratio": out_bytes / source_bytes,
        "clamped": clamped,
        "max_logit_diff": difference,
        "note": note,
    }


def describe_export(config: ExportConfig, result: dict) -> list[str]:
    """The lines `exactresume export` prints."""
    lines = [
        f"exported {config.source} -> {config.out}: {config.dtype} {config.format}, {result['bytes']:,} bytes",
        f"size: {result['size_ratio']:.3f}x the source file ({result['source_bytes']:,} bytes)",
    ]
    if result["clamped"]:
        lines.append(f"clamped {result['clamped']:,} values to ±65504 (--clamp)")
    if result["max_logit_diff"] is None:
        lines.append(result["note"])
    else:
        lines.append(f"max |logit difference| {result['max_logit_diff']:.3e} {result['note']}")
    return lines
