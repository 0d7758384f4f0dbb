"""The doctor's tracer in this process: a record per optimizer step, what a save holds and lacks, and
every patch taken off again."""

from __future__ import annotations

import json
import os

import torch

from exactresume.doctor.tracer.fingerprint import digest
from exactresume.doctor.tracer.hooks import Tracer
from exactresume.doctor.tracer.install import install


def events(folder) -> list[dict]:
    (trace,) = [name for name in os.listdir(folder) if name.startswith("trace-")]
    return [json.loads(line) for line in open(os.path.join(folder, trace))]


def test_steps_saves_and_undo(tmp_path):
    originals = (torch.save, torch.load, torch.nn.Module.__call__, torch.Tensor.backward, os.replace)
    tracer = Tracer(str(tmp_path / "trace"), limit=10**9, crash_from=None)
    remove = install(tracer)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for _ in range(3):
            loss = model(torch.randn(2, 4)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    finally:
        remove()
        tracer.close({"event": "exit", "steps": tracer.step})
    assert (torch.save, torch.load, torch.nn.Module.__call__, torch.Tensor.backward, os.replace) == originals
    records = events(tmp_path / "trace")
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["lr"][0] for s in steps] == [1e-3, 5e-4, 2.5e-4]
    assert len({s["params"] for s in steps}) == 3 and all(len(s["micro"]) == 1 and s["loss"] for s in steps)
    (save,) = [r for r in records if r["event"] == "save"]
    assert save["path"] == str(tmp_path / "ckpt.pt") and save["step"] == 3 and save["pending_micro"] == 0
    saved = {row["kind"]: row["saved"] for row in save["live"]}
    assert saved == {"model": True, "optimizer": True, "lr_scheduler": False}


def test_fingerprints_see_dtype_shape_and_values():
    a = torch.arange(6, dtype=torch.float32)
    assert digest(a) == digest(a.clone()) == digest({"x": [a]}["x"][0])
    assert len({digest(a), digest(a.half()), digest(a.reshape(2, 3)), digest(a + 1)}) == 4
