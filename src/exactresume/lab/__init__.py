"""The lab of the specification (lab), the ablation of every resume part (ablate) and the warm
fork server that starts the lab's training processes. Imports report, train and below.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    # `exactresume.lab` was one module before it became this package: its names still resolve.
    return getattr(importlib.import_module("exactresume.lab.lab"), name)
