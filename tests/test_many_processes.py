"""`--nproc 2`: SIGTERM through torchrun, the training features on two processes, the N-process refusals.

One combined run covers the README's claims for N > 1: on the tiny corpus, the epoch loader (its
short last batch of 6 split 3 + 3 over the ranks, then 2 + 1 into micro-batches), --grad-accum 2,
dropout and bf16, stopped by SIGTERM sent to the `exactresume` command only, and resumed on the
same N with --divergence watching: bit-identical to the uninterrupted 2-process run. Three
torchrun starts in all (straight, stopped, resumed), a few steps each.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exactresume.core.epochs import EpochLoader
from exactresume.core.steplog import read_divergence
from exactresume.errors import UserError
from exactresume.parallel.replicas import process_group
from exactresume.parallel.replicate import replicate
from exactresume.store.numbered import CheckpointStore
from exactresume.store.weights import read_weights
from exactresume.world import World
from helpers import (
    assert_one_line_error,
    call_cli,
    children,
    free_port,
    process_state,
    ranks_of,
    run_cli,
    spawn_cli,
)

# 30 windows of 8 tokens: an epoch of batches 8, 8, 8 and 6; 12 steps are three epochs.
FEATURES = ["--loader", "epoch", "--seq-len", "8", "--batch", "8", "--grad-accum", "2", "--dropout", "0.1"]
FEATURES += ["--dtype", "bf16", "--steps", "12", "--nproc", "2", "--preset", "tiny"]


def flags(folder: Path, data: Path, *extra: object) -> list[str]:
    return [str(arg) for arg in ("train", "--out", folder, "--data", data, *FEATURES, *extra)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_folder) -> Path:
    """The run straight on 2 processes; the temp folder it was given (TMPDIR) beside it (temp_of)."""
    folder = tmp_path_factory.mktemp("straight2")
    temp_of(folder).mkdir()
    run_cli(*flags(folder, tiny_folder), check=True, env={"TMPDIR": str(temp_of(folder))})
    return folder


def temp_of(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}-temp")


def test_a_run_on_two_processes_leaves_nothing_in_the_temp_folder(straight):
    assert (straight / "final.pth").is_file()
    assert list(temp_of(straight).iterdir()) == []  # torch's agent alone leaves a torchelastic_* folder


def logged_steps(folder: Path) -> int:
    try:
        return len((folder / "log.csv").read_text().splitlines()) - 1
    except FileNotFoundError:
        return 0


def stop_with_sigterm(folder: Path, data: Path) -> subprocess.CompletedProcess:
    """Start the 2-process run, SIGTERM the `exactresume` command once its first step is logged.

    The ranks are frozen from then until the signal has reached them, so that it cannot come after
    their last step however slowly the launcher and the agent pass it on (a busy machine's seconds)."""
    command = flags(folder, data, "--resume", "auto")
    child = spawn_cli(*command, env={"OMP_NUM_THREADS": "1"})
    while logged_steps(folder) == 0 and child.poll() is None:
        time.sleep(0.01)
    ranks = ranks_of(child)
    signal_each(ranks, signal.SIGSTOP)
    # Stopped, not only asked to: a rank the scheduler had not run yet would take a SIGTERM arriving
    # first (the lower number goes first) before it stopped, and never show it pending below.
    while not all(process_state(rank) in ("T", None) for rank in ranks):
        time.sleep(0.001)
    child.send_signal(signal.SIGTERM)  # to the command only: it passes it through torchrun to every rank
    deadline = time.monotonic() + 60
    while not all(sigterm_pending(rank) for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    signal_each(ranks, signal.SIGCONT)
    stdout, stderr = child.communicate()
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def signal_each(pids: list[int], number: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # one that ended is what the test then finds
            os.kill(pid, number)


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for process `pid` (frozen, it takes it when it goes on), or it ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(pending >> (signal.SIGTERM - 1) & 1)


def test_sigterm_under_two_processes_saves_one_step_and_resumes_bit_identical(tmp_path, tiny_folder, straight):
    folder = tmp_path / "run"
    stopped = stop_with_sigterm(folder, tiny_folder)
    assert stopped.returncode == 75, f"exit {stopped.returncode} (ended before the signal?): {stopped.stderr}"
    lines = [line for line in stopped.stderr.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1, stopped.stderr  # the ranks' line, printed once
    step = int(re.search(r"stopped by SIGTERM after step (\d+); saved", lines[0]).group(1))
    assert 1 <= step < 12
    # The ranks agreed: one checkpoint, of the step every rank stopped after, and the log up to it.
    assert [c.step for c in CheckpointStore(folder / "checkpoints").checkpoints()] == [step]
    assert logged_steps(folder) == step
    resumed = run_cli(*flags(folder, tiny_folder, "--resume", "auto", "--divergence", folder / "divergence.csv"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {step}" in resumed.stdout
    assert "-process run on" not in resumed.stdout, resumed.stdout  # the twin (one process) restores unsaid
    expected, got = read_weights(straight / "final.pth")[0], read_weights(folder / "final.pth")[0]
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert (folder / "log.csv").read_bytes() == (straight / "log.csv").read_bytes()
    assert [row["step"] for row in read_divergence(folder / "divergence.csv")] == list(range(step + 1, 13))


# -- refusals: one line, exit 2 -----------------------------------------------------------------------


def test_an_epoch_whose_last_batch_does_not_split_over_the_processes_is_refused(tmp_path, tiny_folder):
    # 15 windows of 16 tokens in batches of 4: the last batch holds 3, which 2 processes cannot share.
    finished = call_cli("train", "--out", tmp_path, "--data", tiny_folder, "--loader", "epoch", "--batch", 4,
                        "--seq-len", 16, "--steps", 4, "--nproc", 2)  # fmt: skip
    assert_one_line_error(
        finished,
        "--loader epoch: each epoch ends with a batch of 3 sequences, not divisible by 2 processes, whatever the "
        "--batch: the epoch holds 15 sequences; choose a --seq-len",
    )
    assert not (tmp_path / "log.csv").exists()


def fake_run(device: str, loader=None) -> SimpleNamespace:
    config = SimpleNamespace(batch=4, grad_accum=1, micro_batch=0)
    return SimpleNamespace(config=config, device=torch.device(device), batches=loader, replicas=None)


def test_every_rank_refuses_cuda_with_many_processes():
    """Many processes run on the CPU (gloo): a rank with a CUDA run refuses before joining DDP."""
    for rank in (0, 1):
        with pytest.raises(UserError) as refused:
            replicate(fake_run("cuda"), World(rank, 2))
        assert str(refused.value) == "--device cuda with --nproc 2: many processes run on the CPU (gloo) only"


def test_every_rank_refuses_an_epoch_that_does_not_split(tiny_folder):
    from exactresume.core.data import load_tokens

    loader = EpochLoader(load_tokens(tiny_folder).train, batch=4, seq_len=16, seed=0)
    for rank in (0, 1):
        with pytest.raises(UserError, match="each epoch ends with a batch of 3 sequences, not divisible by 2"):
            replicate(fake_run("cpu", loader), World(rank, 2))


def _free_the_model_after_the_group(rank: int, ports: list[int]) -> None:
    for port in ports:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        with process_group(World(rank, 2)):
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
            model(torch.ones(2, 4)).sum().backward()
        del model  # the run outlives its group: the reducer's reference to the group goes last


def test_a_ddp_model_freed_after_its_group_ended_does_not_hang_the_rank():
    # By hand, with the group not kept: the ranks hung within 10 rounds in each of four tries (gloo's
    # worker thread waited for the interpreter lock, held by the reducer's destructor, which waited
    # for that thread); with it kept, 200 rounds ended.
    ports = [free_port() for _ in range(12)]
    ranks = torch.multiprocessing.start_processes(
        _free_the_model_after_the_group, args=(ports,), nprocs=2, start_method="fork", join=False
    )
    deadline = time.monotonic() + 60
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank hung after its process group ended")


def test_an_agent_killed_with_kill_9_leaves_nothing_in_the_temp_folder(tmp_path, tiny_folder):
    """The agent's files for its ranks are the launcher's to remove: the agent cannot, once killed."""
    folder, temp = tmp_path / "run", tmp_path / "temp"
    temp.mkdir()
    command = flags(folder, tiny_folder, "--steps", 400, "--save-every", 50, "--progress", "none")
    child = spawn_cli(*command, env={"OMP_NUM_THREADS": "1", "TMPDIR": str(temp)})
    while logged_steps(folder) < 1 and child.poll() is None:
        time.sleep(0.01)
    assert [path.name.split("-")[1] for path in temp.iterdir()] == ["ranks"]  # exactresume-ranks-*, while it runs
    os.kill(children()[child.pid][0], signal.SIGKILL)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode != 0 and "Traceback" not in stderr, stderr
    assert list(temp.iterdir()) == []


def test_a_rank_killed_alone_ends_the_run_in_one_line_and_auto_resume_continues(tmp_path, tiny_folder, straight):
    folder = tmp_path / "run"
    command = flags(folder, tiny_folder, "--save-every", 2, "--progress", "none")
    (tmp_path / "temp").mkdir()
    child = spawn_cli(*command, env={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "temp")})
    while logged_steps(folder) < 3 and child.poll() is None:
        time.sleep(0.01)
    ranks = ranks_of(child)
    signal_each(ranks, signal.SIGSTOP)  # held mid-run: the kill lands before the run can end
    os.kill(ranks[-1], signal.SIGKILL)
    signal_each(ranks[:-1], signal.SIGCONT)
    stdout, stderr = child.communicate()
    assert stderr.count("\n") == 1 and "Traceback" not in stderr and "E1" not in stderr, stderr
    # the agent names the rank it saw fail first: the one killed, or one whose peer vanished
    named = re.fullmatch(
        r"exactresume train: error: rank \d \(pid \d+\) was ended by SIGKILL .*--resume auto\n", stderr
    )
    assert (named and child.returncode == 128 + signal.SIGKILL) or (
        "a rank was ended from outside" in stderr and child.returncode == 1
    ), (child.returncode, stderr)
    assert list((tmp_path / "temp").iterdir()) == []  # torch's file of the traceback of the rank whose peer died
    run_cli(*command, "--resume", "auto", check=True)
    for name, tensor in read_weights(straight / "final.pth")[0].items():
        assert torch.equal(read_weights(folder / "final.pth")[0][name], tensor), name
