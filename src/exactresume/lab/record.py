"""What a lab folder records about how it was made: its config and the machine (details/run.json).

docs/lab.md's lab block is rendered from a copy of the lab's json files in docs/lab/; with this
record beside them a test can tell when that copy was made with another config than today's
defaults, and a reader which machine the numbers came from.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict

import torch

RUN_RECORD = "run.json"  # in the lab's details/ folder


def machine() -> dict:
    """The machine and software the numbers depend on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def config_record(config) -> dict:
    """A LabConfig's result-deciding fields: the training config, where it stops, how many processes."""
    return {"train": asdict(config.train), "stop_at": config.stop_at, "nproc": config.nproc}


def run_record(config) -> dict:
    return {"config": config_record(config), "machine": machine()}
