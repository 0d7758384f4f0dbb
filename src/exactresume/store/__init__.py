"""Everything on disk: the resume file of parts (resume), sealed and atomic writes, the checkpoint
folder (folder.CheckpointStore), background saves, fault injection, sharded DCP folders, weights
and safetensors, inspect and export, the per-step logs. Imports core and the base layer only.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    # `exactresume.store` was one module before it became this package: its names still resolve.
    return getattr(importlib.import_module("exactresume.store.folder"), name)
