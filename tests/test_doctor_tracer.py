"""The doctor's tracer in this process: a record per optimizer step, what a save holds and lacks, and
every patch taken off again."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

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


def test_a_closure_step_owns_the_forward_inside_it(tmp_path):
    """Lightning and LBFGS run the forward inside optimizer.step(closure): the step gets that batch."""
    tracer = Tracer(str(tmp_path / "trace"), limit=10**9, crash_from=None)
    remove = install(tracer)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        inputs, grads = [torch.randn(2, 4) for _ in range(3)], []
        for x in inputs:

            def closure(x=x):
                optimizer.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                return loss

            optimizer.step(closure)
            grads.append(digest([p.grad for p in model.parameters()]))
    finally:
        remove()
        tracer.close({"event": "exit", "steps": tracer.step})
    steps = [r for r in events(tmp_path / "trace") if r["event"] == "step"]
    assert [s["micro"] for s in steps] == [[digest((x,), {})] for x in inputs]
    assert [s["grads"] for s in steps] == grads and all(s["loss"] for s in steps)


def test_every_writer_of_files_is_seen_and_what_was_there_is_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("before")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "a.txt").write_text("old")
    originals = (open, os.open, os.mkdir, os.remove, shutil.rmtree)
    tracer = Tracer(str(tmp_path / "trace"), limit=10**9, crash_from=None, keep=str(tmp_path / "keep"))
    remove = install(tracer)
    try:
        os.makedirs(tmp_path / "made" / "deep")
        with open(tmp_path / "made" / "deep" / "state.json", "w") as file:
            json.dump({"step": 1}, file)
        with open(tmp_path / "notes.txt", "a") as file:
            file.write(" and after")
        shutil.rmtree(tmp_path / "old")
        with tempfile.TemporaryFile(dir=tmp_path) as unnamed:  # O_TMPFILE on Linux: the folder is not written
            unnamed.write(b"scratch")
    finally:
        remove()
        tracer.close({"event": "exit", "steps": tracer.step})
    assert (open, os.open, os.mkdir, os.remove, shutil.rmtree) == originals
    records = events(tmp_path / "trace")
    wrote = {r["path"]: r["new"] for r in records if r["event"] == "wrote"}
    assert wrote == {
        str(tmp_path / "made"): True,
        str(tmp_path / "made" / "deep"): True,
        str(tmp_path / "made" / "deep" / "state.json"): True,
        str(tmp_path / "notes.txt"): False,
        str(tmp_path / "old"): False,
    }
    kept = {r["path"]: r["copy"] for r in records if r["event"] == "kept"}
    assert open(kept[str(tmp_path / "notes.txt")]).read() == "before"
    assert open(os.path.join(kept[str(tmp_path / "old")], "a.txt")).read() == "old"


def test_a_rank_ends_at_the_step_the_saving_rank_marked_not_before(tmp_path):
    """Under torchrun the rank that saved marks its step; another rank that reads the marker while it
    is being written (empty: open truncates first) goes on, and ends once it reaches that step."""
    tracer = Tracer(str(tmp_path / "trace"), limit=10**9, crash_from=4)
    open(tracer.marker, "w").close()
    tracer.step = 5
    assert not tracer.marked()
    with open(tracer.marker, "w") as marker:
        marker.write("6")
    assert not tracer.marked()
    tracer.step = 6
    assert tracer.marked()
