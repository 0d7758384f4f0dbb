"""The built-in trainer's public names, apart from the library's: its config, data, model, and building
and training a run (they need the lab extra, `pip install 'exactresume[lab]'`):

    from exactresume.trainer import TrainConfig, build_run, load_tokens, train

Loaded on first use, as the package's own names are.
"""

from __future__ import annotations

from exactresume import _lazy_name

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
    return _lazy_name(__name__, PUBLIC, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
