"""On a GPU: `train --device cuda` and a loop of one's own on CUDA resume bit-exactly in a new process.
Skipped where torch sees no CUDA device (CI has none); docs/training.md says where it last ran.

Each run is a fresh `python -m exactresume` (no fork server: a process forked after CUDA started
cannot use it). The CUDA RNG is what dropout on the GPU draws from, so each case trains with dropout,
and the loop of one's own shows the check can fail: resumed without its RNG part, it ends elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import SMALL, assert_weights_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

EPOCH = ["--loader", "epoch", "--batch", "4"]
KEY = {"EXACTRESUME_KEY": "a key of at least sixteen bytes"}

# name: (flags of every run, stop at, environment)
CASES = {
    "fp32-epoch-workers-dropout": (EPOCH + ["--workers", "2", "--dropout", "0.1"], 2, {}),
    "bf16-dropout-accum": (["--dtype", "bf16", "--dropout", "0.1", "--grad-accum", "2"], 3, {}),
    "fp16-scaler-dropout-keyed": (["--dtype", "fp16", "--dropout", "0.1"], 5, KEY),
}


def exactresume(*args: object) -> None:
    """`python -m exactresume ARGS` in a new process; a failure shows its stderr."""
    finished = subprocess.run(
        [sys.executable, "-m", "exactresume", *map(str, args)],
        capture_output=True,
        text=True,
    )
    assert finished.returncode == 0, finished.stderr


@pytest.mark.parametrize("name", CASES)
def test_a_cuda_run_resumes_bit_identically(name, tmp_path, tiny_folder, monkeypatch):
    flags, stop_at, env = CASES[name]
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)  # the keyed case's weights are read with its key
    common = ["--data", tiny_folder, "--device", "cuda", *SMALL, *flags]
    exactresume("train", "--out", tmp_path / "straight", *common, "--weights", tmp_path / "straight.pth")
    exactresume("train", "--out", tmp_path / "stopped", *common, "--stop-at", stop_at)
    resume_file = tmp_path / "stopped" / "resume.pth"
    exactresume(
        "train", "--out", tmp_path / "stopped", *common, "--resume", resume_file, "--weights", tmp_path / "resumed.pth",
    )  # fmt: skip
    assert torch.load(resume_file, weights_only=True)["rng"]["cuda"], "the resume file holds no CUDA RNG state"
    assert_weights_equal(tmp_path / "straight.pth", tmp_path / "resumed.pth")


# A loop of one's own on the GPU: dropout draws from the CUDA RNG, batches from a CUDA generator.
OWN_LOOP = textwrap.dedent(
    """
    import sys
    import torch
    from exactresume import CheckpointStore, GeneratorPart, GlobalRng

    mode, folder, out = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.Generator(device="cuda").manual_seed(1)
    parts = {"model": model, "optimizer": optimizer, "batches": GeneratorPart(batches), "rng": GlobalRng()}
    with CheckpointStore(folder, keep=2) as store:
        step = store.load(parts, skip=("rng",) if mode == "resume-without-rng" else ()) or 0
        while step < 8:
            x = torch.randn(16, 32, device="cuda", generator=batches)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if mode == "stop" and step == 4:
                store.save(step, parts)
                sys.exit(0)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out)
    """
)


def test_a_loop_of_ones_own_on_cuda_resumes_bit_identically_and_only_with_its_rng(tmp_path):
    program = tmp_path / "loop.py"
    program.write_text(OWN_LOOP)

    def run(mode: str, folder: Path, out: Path) -> None:
        finished = subprocess.run([sys.executable, program, mode, folder, out], capture_output=True, text=True)
        assert finished.returncode == 0, finished.stderr

    run("straight", tmp_path / "none", tmp_path / "straight.pth")
    run("stop", tmp_path / "checkpoints", tmp_path / "unused.pth")
    run("resume", tmp_path / "checkpoints", tmp_path / "resumed.pth")
    run("resume-without-rng", tmp_path / "checkpoints", tmp_path / "without_rng.pth")
    straight, resumed, without_rng = (
        torch.load(tmp_path / name, weights_only=True) for name in ("straight.pth", "resumed.pth", "without_rng.pth")
    )
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    assert not all(torch.equal(straight[name], without_rng[name]) for name in straight), "the CUDA RNG went unused"


def python(code: str) -> None:
    finished = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr


def test_a_process_that_never_started_cuda_saves_no_cuda_rng_and_does_not_start_it():
    python(
        """
        import torch
        from exactresume import GlobalRng
        torch.manual_seed(0)
        assert GlobalRng().state_dict()["cuda"] == [] and not torch.cuda.is_initialized()
        """
    )


def test_the_saved_states_of_more_gpus_than_a_process_sees_restore_the_ones_it_sees():
    python(
        """
        import torch
        from exactresume import GlobalRng
        torch.cuda.manual_seed(1)
        torch.zeros(1, device="cuda")  # CUDA started: its states are saved
        state = GlobalRng().state_dict()
        assert len(state["cuda"]) == torch.cuda.device_count() > 0
        state["cuda"] = state["cuda"] + [state["cuda"][0].clone()]  # one GPU more than this process sees
        drawn = torch.rand(4, device="cuda")
        GlobalRng().load_state_dict(state)
        assert torch.equal(torch.rand(4, device="cuda"), drawn)
        """
    )
