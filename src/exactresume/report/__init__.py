"""The lab's report: markdown (report), tables (tables), figures and their captions, drawn only from
the json and csv files a run wrote. Imports store, core and the base layer.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    # `exactresume.report` was one module before it became this package: its names still resolve.
    return getattr(importlib.import_module("exactresume.report.report"), name)
