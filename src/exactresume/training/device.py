"""Where and in which precision a run computes: the device, its determinism switches, autocast and
the loss scaler.

Weights, gradients and optimizer moments stay fp32 in every precision; `--dtype bf16|fp16` only
autocasts the forward pass. fp16's narrow exponent needs a GradScaler, whose scale and growth
counter change during training and are therefore a part of the resume file (`scaler`); for fp32
and bf16 the scaler is disabled, passes everything through, and is not in the file.
"""

from __future__ import annotations

import contextlib
import os

import torch

from exactresume.config import TrainConfig
from exactresume.errors import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def training_device(config: TrainConfig) -> torch.device:
    """The run's device; on CUDA, deterministic kernels are switched on before any CUDA work."""
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                "--device cuda: no CUDA device is available to this torch (torch.cuda.is_available() is False)"
            )
        # cuBLAS reads this when it first starts; without it deterministic mode refuses matmuls.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return torch.device(config.device)


def precision_context(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to the run's dtype for the forward pass; nothing at all for fp32."""
    if config.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[config.dtype])


def loss_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (disabled, it passes losses and steps through unchanged)."""
    return torch.amp.GradScaler(device.type, enabled=config.dtype == "fp16")
