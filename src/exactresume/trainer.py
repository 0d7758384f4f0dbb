"""The built-in trainer's public names, apart from the library's: its config, data, model, and building
and training a run (they need the lab extra, `pip install 'exactresume[lab]'`):

    from exactresume.trainer import TrainConfig, build_run, load_tokens, train

Loaded on first use, as the package's own names are.
"""

from __future__ import annotations

import importlib

# public name -> the module that holds it
PUBLIC = {
    "ModelConfig": "exactresume.config",
    "TrainConfig": "exactresume.config",
    "PRESETS": "exactresume.config",
    "MiniMindLM": "exactresume.core.model",
    "load_tokens": "exactresume.core.data",
    "prepare": "exactresume.core.data",
    "PrepareConfig": "exactresume.core.data",
    "load_model": "exactresume.training.inference",
    "build_run": "exactresume.training.loop",
    "train": "exactresume.training.loop",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'exactresume.trainer' has no attribute {name!r}")
    from exactresume.errors import extras_needed

    with extras_needed():  # without the lab extra: one line naming it
        return getattr(importlib.import_module(PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
