"""Old import paths keep working: `exactresume.checkpoint`, `exactresume.store.CheckpointStore`, ...

The flat modules of version 0.1 now live in subpackages by layer. Users' loops import the old
names, so each old module path is served by a module that forwards to the new homes. A name that
moved to another module than the rest of its old neighbours is listed in `EXTRA`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

# old module (under exactresume.) -> the module that holds most of it now
MOVED = {
    "model": "core.model",
    "data": "core.data",
    "batches": "core.batches",
    "epochs": "core.epochs",
    "compare": "core.compare",
    "checkpoint": "store.resume",
    "sealed": "store.sealed",
    "background": "store.background",
    "faults": "store.faults",
    "sharded": "store.sharded",
    "weights": "store.weights",
    "safetensors_weights": "store.safetensors_weights",
    "inspection": "store.inspect",
    "export": "store.export",
    "steplog": "store.steplog",
    "train": "training.loop",
    "parts": "training.parts",
    "device": "training.device",
    "job": "training.job",
    "preemption": "training.preemption",
    "divergence": "training.divergence",
    "distributed": "dist.replicas",
    "launcher": "dist.launcher",
    "ablate": "lab.ablate",
    "warm_start": "lab.warm_start",
    "figures": "report.figures",
    "captions": "report.captions",
}
# old module -> {name: its new module}, for names that left their old neighbours
EXTRA = {
    "model": {"load_model": "store.weights"},
    "compare": {"read_loss_log": "store.steplog", "read_samples": "store.steplog"},
    "divergence": {"read_divergence": "store.steplog"},
    "ablate": {
        name: "report.tables"
        for name in (
            "render_table",
            "render_markdown",
            "ablation_lines",
            "readme_block",
            "write_readme_block",
            "TABLE_TEXT",
            "BEGIN_MARKER",
            "END_MARKER",
        )
    },
    "distributed": {
        "World": "world",
        "PerRank": "store.resume",
        "saved_states": "store.resume",
        "saved_world_size": "store.resume",
        "is_sharded_folder": "store.access",
        "save_checkpoint": "store.access",
        "restore_checkpoint": "store.access",
    },
    "launcher": {"launched_by_torchrun": "world"},
    "parts": {"Stateful": "store.resume"},
}


def extra_attribute(old: str, name: str):
    """`name` of the old module `old`, from its new home (AttributeError when it never was there)."""
    new = EXTRA.get(old, {}).get(name)
    if new is None:
        raise AttributeError(f"module 'exactresume.{old}' has no attribute {name!r}")
    return getattr(importlib.import_module(f"exactresume.{new}"), name)


class _Forwarding(types.ModuleType):
    """An old module path: attributes come from the new module, then from EXTRA."""

    def __getattr__(self, name: str):
        try:
            return getattr(self.__dict__["_target"], name)
        except AttributeError:
            return extra_attribute(self.__dict__["_old"], name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        old = spec.name.removeprefix("exactresume.")
        module = _Forwarding(spec.name, f"moved to exactresume.{MOVED[old]}")
        module._old, module._target = old, importlib.import_module(f"exactresume.{MOVED[old]}")
        return module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("exactresume.") and fullname.removeprefix("exactresume.") in MOVED:
            return importlib.util.spec_from_loader(fullname, _Loader())
        return None


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
