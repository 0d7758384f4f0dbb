"""A user's own loop saving in the background (PROGRAM below, written from docs/library.md alone): a
model with BatchNorm, AdamW, an EMA of the model updated in place right after each `store.save`.
Each run is its own process. With the default copy the file at step N holds the state at N (read back
with a plain torch.load); with copy="during-next-step" the same loop is refused in one line and no
file is written; a full disk is one StorageError line; the earlier checkpoints never change."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from helpers import run_python

PROGRAM = '''
"""Train a small model, save every step in the background, keep an EMA of the model's state."""
import argparse
import json
import sys

import torch

from exactresume import CheckpointStore, GeneratorPart, StorageError, UserError

flags = argparse.ArgumentParser()
flags.add_argument("folder")
flags.add_argument("--steps", type=int, default=4)
flags.add_argument("--copy")  # the store's copy=, when the user passes one
flags.add_argument("--ema", action="store_true")  # update the EMA in place right after each save
flags.add_argument("--expected")  # a folder for the state each save was asked to hold, cloned at save
flags.add_argument("--file-size-limit", type=int)  # the test's stand-in for a full disk: RLIMIT_FSIZE
args = flags.parse_args()

torch.manual_seed(0)
make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1))
model, ema = make(), make()
ema.load_state_dict(model.state_dict())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
parts = {"model": model, "optimizer": optimizer, "ema": ema, "data": GeneratorPart(data)}


def update_ema():
    with torch.no_grad():
        for average, value in zip(ema.state_dict().values(), model.state_dict().values()):
            average.lerp_(value, 0.5) if average.is_floating_point() else average.copy_(value)


store = CheckpointStore(args.folder, keep=None, background=True, **({"copy": args.copy} if args.copy else {}))
start = store.load(parts) or 0
if args.file_size_limit:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, resource.RLIM_INFINITY))
step = start
try:
    for step in range(start + 1, args.steps + 1):
        inputs = torch.randn(16, 8, generator=data)
        loss = (model(inputs) - inputs.sum(dim=1, keepdim=True)).pow(2).mean()  # BatchNorm in train mode
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        store.save(step, parts)
        if args.ema:
            update_ema()
    store.close()
except UserError as error:
    print("caught: " + json.dumps({"type": type(error).__name__, "message": str(error), "step": step}))
    sys.exit(error.exit_code)
print(f"trained steps {start + 1} to {args.steps}")
'''


def program(tmp_path: Path) -> Path:
    """PROGRAM, where each save also clones the state it was asked to hold into --expected."""
    text = PROGRAM.replace(
        "        store.save(step, parts)\n",
        "        if args.expected:\n"
        "            clone = {name: {k: v.clone() for k, v in part.state_dict().items()} for name, part in"
        ' [("model", model), ("ema", ema)]}\n'
        '            torch.save(clone, f"{args.expected}/{step}.pt")\n'
        "        store.save(step, parts)\n",
    )
    path = tmp_path / "user_loop.py"
    path.write_text(text)
    return path


def fingerprints(folder: Path) -> dict[str, str]:
    """Every checkpoint file and leftover in the folder, by name, and the hash of its bytes."""
    files = [path for path in sorted(folder.iterdir()) if path.name != ".exactresume.lock"]
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def caught(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("caught: ")]
    assert len(lines) == 1, output
    return json.loads(lines[0].removeprefix("caught: "))


def run_loop(tmp_path: Path, folder: Path, *args: object):
    return run_python(program(tmp_path), folder, *args, env={"OMP_NUM_THREADS": "1"})


def saved(folder: Path, step: int) -> dict:
    return torch.load(folder / f"step-{step:08d}.pth", weights_only=True)


@pytest.mark.parametrize("ema", [True, False], ids=["ema-updated-after-save", "batchnorm-forward-after-save"])
def test_by_default_each_file_holds_the_state_at_its_step(tmp_path, ema):
    """(a) The EMA updated in place right after `save`; (b) the next step's forward (BatchNorm's running
    statistics) as the first thing after `save`."""
    folder, expected = tmp_path / "run", tmp_path / "expected"
    expected.mkdir()
    finished = run_loop(tmp_path, folder, "--steps", 4, "--expected", expected, *(["--ema"] if ema else []))
    assert finished.returncode == 0, finished.stdout
    for step in range(1, 5):
        state, at_save = saved(folder, step), torch.load(expected / f"{step}.pt", weights_only=True)
        for part in ("model", "ema"):
            for name, tensor in at_save[part].items():
                assert torch.equal(state[part][name], tensor), (step, part, name)
        if step < 4:  # and not the step after: the change after `save` is not in the file
            after = torch.load(expected / f"{step + 1}.pt", weights_only=True)
            changed = "ema" if ema else "model"
            assert not torch.equal(state[changed]["1.running_mean"], after[changed]["1.running_mean"]), step


def test_during_next_step_the_same_loop_is_refused_and_nothing_is_written(tmp_path):
    """(c) The EMA updated in place while the copy runs: one CheckpointError line, no file for the step,
    the earlier checkpoints byte for byte as they were."""
    folder = tmp_path / "run"
    first = run_loop(tmp_path, folder, "--steps", 2, "--ema")  # the default copy: checkpoints 1 and 2
    assert first.returncode == 0, first.stdout
    before = fingerprints(folder)
    assert sorted(before) == ["step-00000001.pth", "step-00000002.pth"]
    refused = run_loop(tmp_path, folder, "--steps", 4, "--ema", "--copy", "during-next-step")
    assert refused.returncode == 2, refused.stdout
    error = caught(refused.stdout)
    message = error["message"]
    assert error["type"] == "CheckpointError" and "\n" not in message, error
    # Named: the first tensor in the state that changed by the time the loop waited (the EMA's, or
    # BatchNorm's count of batches if the next forward ran first).
    named = re.match(
        r"the checkpoint at step 3 was not written: (\S+) changed in place before the loop waited", message
    )
    assert named and (named[1].startswith("ema.") or named[1] == "model.1.num_batches_tracked"), message
    assert "copy='before-return'" in message and "store.wait_for_copy()" in message, message
    assert fingerprints(folder) == before  # no step-00000003.pth, no leftover, nothing changed


def test_a_full_disk_in_the_background_is_one_storage_error_line(tmp_path):
    """(d) The kernel refuses the write (a file-size limit: EFBIG) in the writer thread; the loop
    catches `exactresume.StorageError` at its next save."""
    folder = tmp_path / "run"
    assert run_loop(tmp_path, folder, "--steps", 2, "--ema").returncode == 0
    before = fingerprints(folder)
    size = (folder / "step-00000002.pth").stat().st_size
    full = run_loop(tmp_path, folder, "--steps", 4, "--ema", "--file-size-limit", size // 2)
    assert full.returncode == 74, full.stdout
    error = caught(full.stdout)
    message = error["message"]
    assert error["type"] == "StorageError" and error["step"] == 4, error  # raised by the save after it
    assert "\n" not in message and not message.startswith("(") and "OSError" not in message, message
    assert message.startswith("could not write the checkpoint at step 3 in ") and "(EFBIG)" in message, message
    assert message.endswith("step-00000002.pth is intact"), message
    assert fingerprints(folder) == before
