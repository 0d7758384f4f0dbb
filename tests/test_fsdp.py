"""`--shard fsdp` (FSDP2 on gloo): against one process, resumed on the same N and resharded to another,
and stopped on two torchrun nodes (two agents on this machine) then resumed on one.

Every run is a new process. The two-node run is also the stopped run the resumes start from: on
2 processes on one node it must continue bit-identically to the single-node straight run, on 1
and 4 processes with the same samples and weights equal up to the reduction order.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from exactresume.core.steplog import read_samples
from exactresume.store.faults import FAULT_ENV, STAGES
from helpers import (
    FORKED_TORCHRUN,
    assert_one_line_error,
    assert_weights_equal,
    call_cli,
    descendants,
    free_port,
    max_abs_difference,
    process_state,
    ranks_of,
    run_cli,
    run_python,
    run_torchrun,
    spawn_cli,
    train_cli,
)

# a batch of 4 splits over 1, 2 and 4 processes
FLAGS = ["--steps", "8", "--batch", "4", "--seq-len", "16", "--preset", "tiny"]
STOP = 3
# What only the order of floating-point reduction moves: measured 1.2e-5 to 3.5e-5 over these 8 steps.
CROSS_N_ATOL = 1e-4
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def train(out: Path, data: Path, *flags: object) -> None:
    train_cli(out, "--data", data, *FLAGS, *flags, check=True)


def train_on_two_nodes(out: Path, data: Path, *flags: object) -> None:
    """Two torchrun agents, one process each, meeting through a c10d rendezvous as two machines would."""
    endpoint = f"127.0.0.1:{free_port()}"
    agent = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    command = [*agent, "--rdzv-id", "two-nodes", "-m", "exactresume.cli", "--", "train", "--out", out, "--data", data]
    with ThreadPoolExecutor(2) as nodes:
        agents = [nodes.submit(run_torchrun, *command, *FLAGS, *flags, env=ONE_THREAD) for _node in range(2)]
        for finished in agents:
            assert finished.result().returncode == 0, finished.result().stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kjv_folder):
    """One process without FSDP (the reference), FSDP2 straight on 2, stopped on two nodes and on 1 process."""
    folder = tmp_path_factory.mktemp("fsdp")
    train(folder / "reference", kjv_folder, "--samples", folder / "reference" / "samples.csv")
    train(
        folder / "straight2",
        kjv_folder,
        "--nproc",
        2,
        "--shard",
        "fsdp",
        "--samples",
        folder / "straight2" / "samples.csv",
    )
    train_on_two_nodes(folder / "nodes", kjv_folder, "--shard", "fsdp", "--stop-at", STOP, "--save-every", 2)
    train(folder / "stop1", kjv_folder, "--shard", "fsdp", "--stop-at", STOP)
    return folder


def resumed(runs: Path, tmp_path: Path, data: Path, source: str, nproc: int) -> Path:
    """`source`'s resume.dcp resumed on `nproc` processes in a folder of its own; that folder."""
    out = tmp_path / f"{source}-on-{nproc}"
    out.mkdir()
    shutil.copytree(runs / source / "resume.dcp", out / "resume.dcp")
    train(out, data, "--nproc", nproc, "--shard", "fsdp", "--resume", out / "resume.dcp", "--samples", out / "s.csv")
    return out


def test_two_processes_compute_the_gradient_one_process_does(tmp_path):
    """The gradient itself, not only the weights: AdamW and clipping would hide one N times too large."""
    worker = Path(__file__).with_name("fsdp_gradient.py")
    one = run_python(worker, tmp_path / "one.pt", env={"OMP_NUM_THREADS": "1"})
    two = run_python(FORKED_TORCHRUN, 2, worker, tmp_path / "two.pt", env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == two.returncode == 0, one.stdout + two.stdout
    one, sharded = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one.keys() == sharded.keys()
    for name in one:
        scale = one[name].abs().max()
        assert (sharded[name] - one[name]).abs().max() <= 1e-5 * scale, name


def test_two_processes_train_as_one_does(runs):
    assert max_abs_difference(runs / "reference" / "final.pth", runs / "straight2" / "final.pth") < CROSS_N_ATOL


def test_the_weights_file_keeps_the_tie_as_one_process_does(runs):
    weights = torch.load(runs / "straight2" / "final.pth", weights_only=True)
    head, embedding = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    sizes = [(runs / name / "final.pth").stat().st_size for name in ("reference", "straight2")]
    assert abs(sizes[0] - sizes[1]) < 0.01 * sizes[0], sizes


def test_stopped_on_two_nodes_resumed_on_one_node_is_bit_identical(runs, tmp_path, kjv_folder):
    out = resumed(runs, tmp_path, kjv_folder, "nodes", 2)
    assert_weights_equal(runs / "straight2" / "final.pth", out / "final.pth")


def test_every_rank_writes_its_shard_of_each_checkpoint_and_auto_resume_reads_it(runs, tmp_path, kjv_folder):
    """--save-every under FSDP2 writes each checkpoint sharded, every rank its own rows, nothing gathered on
    one rank; --resume auto continues from it bit-identically on 2 processes, and resharded on 1 and 4."""
    checkpoints = runs / "nodes" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000002.dcp", "step-00000003.dcp"]
    newest = checkpoints / "step-00000003.dcp"
    shards = sorted(newest.glob("*.distcp"))
    assert [path.name for path in shards] == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [path.stat().st_size for path in shards]
    assert max(sizes) < 0.75 * sum(sizes), sizes  # each rank wrote its own rows, not the whole state
    marker = torch.load(newest / "commit.pth", weights_only=True)  # a plain torch file: nothing of ours
    assert (marker["processes"], marker["step"]) == (2, 3)
    listed = run_cli("inspect", checkpoints, check=True).stdout
    assert "2 checkpoints; a resume continues from step 3" in listed and "step-00000003.dcp  verified" in listed
    compared = call_cli("diff", checkpoints, newest)  # a folder of sharded checkpoints: its newest, read whole
    assert compared.returncode == 0 and "equal" in compared.stdout, compared.stdout + compared.stderr
    for nproc in (2, 1, 4):
        out = tmp_path / f"on-{nproc}"
        shutil.copytree(checkpoints, out / "checkpoints")
        train(out, kjv_folder, "--nproc", nproc, "--shard", "fsdp", "--resume", "auto", "--samples", out / "s.csv")
    assert_weights_equal(runs / "straight2" / "final.pth", tmp_path / "on-2" / "final.pth")
    reference = read_samples(runs / "reference" / "samples.csv")
    for nproc in (1, 4):
        assert read_samples(tmp_path / f"on-{nproc}" / "s.csv") == {
            step: reference[step] for step in range(STOP + 1, 9)
        }
        assert (
            max_abs_difference(runs / "reference" / "final.pth", tmp_path / f"on-{nproc}" / "final.pth") < CROSS_N_ATOL
        )


@pytest.mark.parametrize(("source", "nproc"), [("nodes", 1), ("nodes", 4), ("stop1", 2)])
def test_a_resume_on_another_number_of_processes_reshards(runs, tmp_path, kjv_folder, source, nproc):
    out = resumed(runs, tmp_path, kjv_folder, source, nproc)
    reference = read_samples(runs / "reference" / "samples.csv")
    assert read_samples(out / "s.csv") == {step: reference[step] for step in range(STOP + 1, 9)}
    assert max_abs_difference(runs / "reference" / "final.pth", out / "final.pth") < CROSS_N_ATOL


def test_a_folder_of_another_sharding_mode_is_refused(runs, tmp_path, kjv_folder):
    finished = run_cli(
        "train", "--out", tmp_path, "--data", kjv_folder, *FLAGS, "--resume", runs / "nodes" / "resume.dcp"
    )
    assert_one_line_error(finished, "different run", "train.shard 'fsdp' in file, 'none' now")
    assert not (tmp_path / "final.pth").exists()


def test_a_missing_shard_is_refused_before_anything_is_written(runs, tmp_path, kjv_folder):
    shutil.copytree(runs / "nodes" / "resume.dcp", tmp_path / "resume.dcp")
    (tmp_path / "resume.dcp" / "__1_0.distcp").unlink()
    finished = run_cli(
        "train", "--out", tmp_path, "--data", kjv_folder, *FLAGS, "--shard", "fsdp", "--resume", tmp_path / "resume.dcp"
    )
    assert_one_line_error(finished, "__1_0.distcp is missing")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["resume.dcp"]


def test_what_fsdp_does_not_combine_with_is_refused(tmp_path, kjv_folder):
    for flags, needle in (
        (["--micro-batch", "1"], "does not combine with --shard fsdp"),
        (["--save-every", "2", "--async-save"], "--async-save does not combine"),
        (["--resume", "auto", "--divergence", tmp_path / "d.csv"], "--divergence does not combine"),
    ):
        finished = train_cli(tmp_path, "--data", kjv_folder, *FLAGS, "--shard", "fsdp", *flags)
        assert_one_line_error(finished, needle)


@pytest.mark.parametrize("command", ["lab", "ablate"])
def test_the_lab_and_the_ablation_refuse_fsdp(tmp_path, kjv_folder, command):
    finished = call_cli(command, "--out", tmp_path / "out", "--data", kjv_folder, "--shard", "fsdp")
    assert_one_line_error(finished, "without --shard fsdp")
    assert not (tmp_path / "out").exists()


# -- kill -9 under FSDP2, then --resume auto on 2 processes and on 1 ---------------------------------


def killed_mid_run(out: Path, data: Path, victim: str, rng: random.Random, sig: int = signal.SIGKILL) -> int:
    """Start the FSDP2 run on 2 processes, let rank 0 freeze itself at a random stage of a random save,
    send `sig` (kill -9) to `victim` there (the launcher, one rank, or both) and let the rest go on;
    wait until none of its processes is left. Returns the launcher's exit code."""
    fault = f"{rng.choice(STAGES)}@{rng.randint(1, 3)}:stop"
    flags = [*FLAGS, "--nproc", 2, "--shard", "fsdp", "--save-every", 2, "--resume", "auto", "--samples", out / "s.csv"]
    launcher = spawn_cli("train", "--out", out, "--data", data, *flags, env={"OMP_NUM_THREADS": "1", FAULT_ENV: fault})
    deadline = time.monotonic() + 240
    while not any(process_state(pid) == "T" for pid in descendants(launcher.pid)):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    family, ranks = [launcher.pid, *descendants(launcher.pid)], ranks_of(launcher)
    targets = {"launcher": [launcher.pid], "rank": [rng.choice(ranks)], "both": [launcher.pid, rng.choice(ranks)]}
    for pid in targets[victim]:
        os.kill(pid, sig)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    code = launcher.wait(timeout=120)
    while any(process_state(pid) not in ("Z", None) for pid in family):
        assert time.monotonic() < deadline, "a process of the killed run is still there"
        time.sleep(0.05)
    return code


def resume_auto(out: Path, data: Path, *flags: object) -> str:
    """Continue the killed run with --resume auto; what it printed (it must have resumed, not started over)."""
    command = ["train", "--out", out, "--data", data, *FLAGS, "--shard", "fsdp", "--save-every", 2, "--resume", "auto"]
    finished = run_cli(*command, "--samples", out / "s.csv", *flags, check=True)
    assert "resumed from" in finished.stdout, finished.stdout
    return finished.stdout


def test_kills_under_fsdp_then_auto_resume_on_2_is_bit_identical(runs, tmp_path, kjv_folder):
    out, rng = tmp_path / "run", random.Random(17)
    for victim in ("launcher", "rank"):
        killed_mid_run(out, kjv_folder, victim, rng)
    resume_auto(out, kjv_folder, "--nproc", 2)
    assert_weights_equal(runs / "straight2" / "final.pth", out / "final.pth")
    assert (out / "s.csv").read_text() == (runs / "straight2" / "samples.csv").read_text()
    assert (out / "log.csv").read_text() == (runs / "straight2" / "log.csv").read_text()


def test_killed_under_fsdp_then_requeued_on_1_process_has_the_same_samples(runs, tmp_path, kjv_folder):
    out = tmp_path / "run"
    killed_mid_run(out, kjv_folder, "both", random.Random(23))
    assert "resuming a 2-process run on 1" in resume_auto(out, kjv_folder)
    assert (out / "s.csv").read_text() == (runs / "straight2" / "samples.csv").read_text()
    assert max_abs_difference(runs / "straight2" / "final.pth", out / "final.pth") < CROSS_N_ATOL


def test_sigterm_to_the_launcher_under_fsdp_saves_then_resumes_bit_identical(runs, tmp_path, kjv_folder):
    """SIGTERM reaches torchrun, which passes it to every rank once: they stop after the same step and save."""
    out = tmp_path / "run"
    assert killed_mid_run(out, kjv_folder, "launcher", random.Random(5), signal.SIGTERM) == 75
    resume_auto(out, kjv_folder, "--nproc", 2)
    assert_weights_equal(runs / "straight2" / "final.pth", out / "final.pth")
    assert (out / "log.csv").read_text() == (runs / "straight2" / "log.csv").read_text()
