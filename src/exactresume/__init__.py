"""exactresume: stop and resume PyTorch training bit for bit, and see what breaks when you don't.

The public API is what this module exports, one import away (loaded on first use, so
`import exactresume` stays light); module paths inside the package may change while we are 0.x:

    from exactresume import CheckpointStore, GeneratorPart, GlobalRng, save_resume, load_resume
    from exactresume.trainer import TrainConfig, build_run, train    # the built-in trainer's

`Stateful` is PyTorch's own part protocol (DCP's): any object with `state_dict()` and
`load_state_dict()` is a part, so whatever works with DCP works with us.
"""

from __future__ import annotations

import importlib

__version__ = "0.3.0"

# public name -> the module that holds it. What a loop of one's own needs (the store, the parts, the
# errors, the one-file calls, the doctor's check) and the one line for each framework (which imports the
# framework when called); the built-in trainer's names are exactresume.trainer's, and the pieces in
# between are the package's own.
PUBLIC = {
    "UserError": "exactresume.errors",
    "CheckpointError": "exactresume.errors",
    "StorageError": "exactresume.errors",
    "World": "exactresume.world",
    "Stateful": "torch.distributed.checkpoint.stateful",
    "save_resume": "exactresume.store.access",
    "load_resume": "exactresume.store.access",
    "read_resume": "exactresume.store.access",
    "open_resume": "exactresume.store.access",
    "Resumed": "exactresume.store.access",
    "CheckpointStore": "exactresume.store.numbered",
    "S3Config": "exactresume.store.locations",
    "read_weights": "exactresume.store.weights",
    "save_weights": "exactresume.store.weights",
    "GlobalRng": "exactresume.parts",
    "StepCounter": "exactresume.parts",
    "GeneratorPart": "exactresume.parts",
    "ResumableLoader": "exactresume.loaders.resumable",
    "ResumableStream": "exactresume.loaders.hf_stream",
    "check_resume": "exactresume.doctor.check",
    "lightning_resume": "exactresume.integrations.lightning",
    "trainer_resume": "exactresume.integrations.transformers",
    "accelerate_resume": "exactresume.integrations.accelerate",
    "ResumeCheck": "exactresume.doctor.check",
}
# The doctor's names (its verdict draws with numpy and matplotlib) need the lab extra (`pip install
# 'exactresume[lab]'`): they are imported by name, and left out of `from exactresume import *`, which
# works with the library's needs alone.
NEEDS_LAB = ("check_resume", "ResumeCheck")
__all__ = sorted(name for name in PUBLIC if name not in NEEDS_LAB)


def __getattr__(name: str):
    return _lazy_name(__name__, PUBLIC, name)


def _lazy_name(module: str, public: dict[str, str], name: str):
    """`name` of `module`'s public names, imported from where it lives on first use (exactresume.trainer's too)."""
    if name not in public:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    from exactresume.errors import extras_needed

    with extras_needed():  # a name that needs the lab extra, without it: one line naming the extra
        return getattr(importlib.import_module(public[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
