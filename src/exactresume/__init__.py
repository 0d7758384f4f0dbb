"""exactresume: stop and resume PyTorch training bit for bit, and see what breaks when you don't.

The public API, one import away (loaded on first use, so `import exactresume` stays light):

    from exactresume import CheckpointStore, GlobalRng, TrainConfig, build_run, train, save_resume

The house, top to bottom (each layer imports only the ones below it; `lint-imports` checks it):

    cli, commands, summaries the command line: its flags, what each command does, how each ends
    lab, doctor              the lab of the specification; a user's own script stopped and resumed
    report | training        markdown and figures from a run's files | the loop, its parts, one job
    dist                     many processes: DDP replicas, the torchrun launcher
    store                    the resume file, sealed writes, the checkpoint folder, weights, DCP
    core                     what a run computes: the model, the data, the batch generators
    flags                    the run's flags, made from TrainConfig's fields
    config, errors, world, progress   configuration, the one error type, rank and size, progress lines
"""

from __future__ import annotations

import importlib
import sys
import types

from exactresume import _moved

__version__ = "0.2.0"

# public name -> the module that holds it
PUBLIC = {
    "ModelConfig": "config",
    "TrainConfig": "config",
    "PRESETS": "config",
    "UserError": "errors",
    "CheckpointError": "errors",
    "StorageError": "errors",
    "World": "world",
    "MiniMindLM": "core.model",
    "load_tokens": "core.data",
    "prepare": "core.data",
    "PrepareConfig": "core.data",
    "Stateful": "store.resume",
    "capture": "store.resume",
    "restore": "store.resume",
    "save_resume": "store.resume",
    "load_resume": "store.resume",
    "CheckpointStore": "store.folder",
    "BackgroundSaver": "store.background",
    "open_resume": "store.access",
    "make_saver": "store.access",
    "Saver": "store.access",
    "load_model": "store.weights",
    "read_weights": "store.weights",
    "save_weights": "store.weights",
    "GlobalRng": "training.parts",
    "StepCounter": "training.parts",
    "GeneratorPart": "training.parts",
    "RunIdentity": "training.parts",
    "Run": "training.loop",
    "build_run": "training.loop",
    "train": "training.loop",
    "train_step": "training.loop",
}
__all__ = sorted(PUBLIC)

_moved.install()


class _Package(types.ModuleType):
    """This package, whose public names an old module path never hides.

    Importing `exactresume.train` (the 0.1 module, now `training.loop`) would otherwise set the
    package attribute `train` to that module, and `from exactresume import train` would then give
    the module instead of the loop's `train` function.
    """

    def __setattr__(self, name: str, value) -> None:
        if name in PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'exactresume' has no attribute {name!r}")
    return getattr(importlib.import_module(f"exactresume.{PUBLIC[name]}"), name)
