"""docs/lab/ (the README's lab figures) records the config and the machine it was made with, and was
made with today's default config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import exactresume.lab.lab as lab_module
from exactresume.config import TrainConfig
from exactresume.lab.lab import LabConfig, run_lab
from exactresume.lab.record import config_record

DOCS_LAB = Path(__file__).resolve().parents[1] / "docs" / "lab"
RECORD = DOCS_LAB / "details" / "run.json"


class Stop(Exception):
    pass


def test_the_lab_records_its_config_and_machine_first(tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(lab_module, "start_runs_server", lambda: None)
    monkeypatch.setattr(lab_module, "ensure_data", stop)  # the lab's first real step: stop there
    config = LabConfig(train=TrainConfig(steps=12, dropout=0.1), stop_at=5, out=tmp_path, nproc=2)
    with pytest.raises(Stop):
        run_lab(config, progress_mode="none")
    record = json.loads((tmp_path / "details" / "run.json").read_text())
    assert record["config"] == config_record(config)
    assert record["config"]["train"]["steps"] == 12 and record["config"]["stop_at"] == 5
    assert record["config"]["train"]["dropout"] == 0.1 and record["config"]["nproc"] == 2
    assert {"platform", "processor", "cpus", "python", "torch"} <= record["machine"].keys()


def test_docs_lab_steps_are_todays_defaults():
    compare = json.loads((DOCS_LAB / "compare.json").read_text())
    assert (compare["steps"], compare["stop_at"]) == (LabConfig().train.steps, LabConfig().stop_at)


def test_docs_lab_was_made_with_todays_default_config():
    record = json.loads(RECORD.read_text())
    assert record["config"] == config_record(LabConfig()), "docs/lab was made with another config: make lab readme"
    assert record["machine"]["cpus"] and record["machine"]["torch"]
