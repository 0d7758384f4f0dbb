"""Many processes: DDP on 2 processes (gloo), sharded DCP checkpoints, resuming on another N.

Every training run here is a new process; the 2-process ones go through `--nproc 2` (PyTorch's
elastic agent, its ranks forked), one through torchrun started by hand (its ranks cold), and the
killed save, whose surviving sharded checkpoint the other tests resume.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from exactresume.core.steplog import read_loss_log, read_samples
from exactresume.errors import CheckpointError, UserError
from exactresume.lab.lab import LabConfig, _train_flags
from exactresume.parallel.agent import agent_config
from exactresume.parallel.launch import first_error
from exactresume.store.resume import PerRank, read_resume_file
from exactresume.world import World
from helpers import (
    FORKED_TORCHRUN,
    SMALL,
    assert_lab_dict,
    assert_one_line_error,
    assert_same_run,
    assert_weights_equal,
    call_cli,
    max_abs_difference,
    run_python,
    run_torchrun,
    train_cli,
)

# The bound for a resume on another number of processes: only the reduction order differs.
CROSS_N_ATOL = 1e-5
TORCHRUN = ["--standalone", "--nproc-per-node", "2"]  # torchrun's flags


def train(out, data, *flags):
    return train_cli(out, "--data", data, *SMALL, *flags, check=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kjv_folder):
    """Straight 8-step runs on 1 and 2 processes, and each stopped at step 3 with a resume file."""
    folder = tmp_path_factory.mktemp("distributed")
    for n in (1, 2):
        train(folder / f"straight{n}", kjv_folder, "--nproc", n, "--samples", folder / f"straight{n}" / "samples.csv")
        train(folder / f"stop{n}", kjv_folder, "--nproc", n, "--stop-at", 3)
    return folder


@pytest.fixture(scope="module")
def killed(tmp_path_factory, kjv_folder):
    """The same run on 2 processes, saved sharded at step 2; rank 1 then killed mid-way through the next save.

    Leaves resume.dcp (step 2), step2.pth (the same state as one file) and the killed save's resume.dcp.tmp/.
    """
    folder = tmp_path_factory.mktemp("killed")
    worker = Path(__file__).with_name("kill_mid_save.py")
    finished = run_torchrun(*TORCHRUN, worker, kjv_folder, folder, env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode != 0, finished.stdout
    return folder


def test_the_samples_do_not_depend_on_the_number_of_processes(runs):
    one, two = (runs / "straight1" / "samples.csv").read_text(), (runs / "straight2" / "samples.csv").read_text()
    assert one == two and len(one.splitlines()) == 9
    assert all(len(starts) == 2 for starts in read_samples(runs / "straight2" / "samples.csv").values())


def test_forked_ranks_end_as_the_ranks_torchrun_starts_cold(tmp_path, kjv_folder, runs):
    """`--nproc 2` forks its ranks from a process that imported torch; torchrun by hand starts each
    rank as a new Python: the same run, bit for bit."""
    flags = ["--out", tmp_path, "--data", kjv_folder, *SMALL, "--samples", tmp_path / "samples.csv", "--quiet"]
    finished = run_torchrun(*TORCHRUN, "-m", "exactresume", "--", "train", *flags, env={"OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0, finished.stdout
    assert_same_run(tmp_path, runs / "straight2")


def test_forked_ranks_meet_at_a_store_of_their_own_not_at_the_agents(tmp_path):
    """No rank connects to the agent's store while it forks the others (agent.OWN_STORE says why)."""
    script = tmp_path / "store.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n")
    finished = run_python(FORKED_TORCHRUN, 2, script)
    assert finished.returncode == 0, finished.stdout
    assert sorted(line for line in finished.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 False",
        "rank 1 False",
    ]


@pytest.mark.parametrize("stopped", ["resume file at step 3", "sharded folder at step 2"])
def test_same_number_of_processes_resumes_bit_identical(tmp_path, kjv_folder, runs, killed, stopped):
    resume, k = (runs / "stop2" / "resume.pth", 3) if stopped.startswith("resume file") else (killed / "resume.dcp", 2)
    train(tmp_path, kjv_folder, "--nproc", 2, "--resume", resume, "--log", tmp_path / "log.csv")
    assert_weights_equal(runs / "straight2" / "final.pth", tmp_path / "final.pth")
    straight_rows = (runs / "straight2" / "log.csv").read_text().splitlines()
    assert (tmp_path / "log.csv").read_text().splitlines()[1:] == straight_rows[k + 1 :]


def test_checkpoint_store_and_auto_resume_on_two_processes(tmp_path, kjv_folder, runs):
    store = ("--nproc", 2, "--save-every", 2, "--resume", "auto", "--async-save")  # rank 0's writer thread
    train(tmp_path, kjv_folder, *store, "--stop-at", 5)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir())[-1] == "step-00000005.pth"
    for path, step in ((tmp_path / "resume.pth", 5), (tmp_path / "checkpoints" / "step-00000004.pth", 4)):
        assert len(assert_lab_dict(path, step)["rng"]["per_rank"]) == 2
    finished = train(tmp_path, kjv_folder, *store)
    assert "resumed from" in finished.stdout and "step 5" in finished.stdout
    assert_weights_equal(runs / "straight2" / "final.pth", tmp_path / "final.pth")
    assert (tmp_path / "log.csv").read_text() == (runs / "straight2" / "log.csv").read_text()


def test_two_to_one_process_same_samples_and_close_weights(tmp_path, kjv_folder, runs, killed):
    finished = train(tmp_path, kjv_folder, "--resume", killed / "resume.dcp", "--samples", tmp_path / "samples.csv")
    assert "resuming a 2-process run on 1" in finished.stdout
    straight = read_samples(runs / "straight2" / "samples.csv")
    assert read_samples(tmp_path / "samples.csv") == {step: straight[step] for step in range(3, 9)}
    assert max_abs_difference(runs / "straight2" / "final.pth", tmp_path / "final.pth") <= CROSS_N_ATOL
    # The first resumed step starts from the same weights: its loss differs only by the reduction order.
    straight_log, resumed_log = read_loss_log(runs / "straight2" / "log.csv"), read_loss_log(tmp_path / "log.csv")
    assert abs(float(resumed_log[3]) - float(straight_log[3])) <= 2e-6


def test_one_to_two_processes_same_samples_and_close_weights(tmp_path, kjv_folder, runs):
    train(
        tmp_path,
        kjv_folder,
        "--nproc",
        2,
        "--resume",
        runs / "stop1" / "resume.pth",
        "--samples",
        tmp_path / "samples.csv",
    )
    straight = read_samples(runs / "straight1" / "samples.csv")
    assert read_samples(tmp_path / "samples.csv") == {step: straight[step] for step in range(4, 9)}
    assert max_abs_difference(runs / "straight1" / "final.pth", tmp_path / "final.pth") <= CROSS_N_ATOL


def test_resume_file_holds_every_ranks_state(runs):
    state = torch.load(runs / "stop2" / "resume.pth", weights_only=True)
    assert len(state["rng"]["per_rank"]) == 2
    # Every rank draws the same global batch, so the generator's state is saved once, as one process saves it.
    single = torch.load(runs / "stop1" / "resume.pth", weights_only=True)
    assert isinstance(state["gen_state"], torch.Tensor) and isinstance(single["gen_state"], torch.Tensor)
    assert torch.equal(state["gen_state"], single["gen_state"])


def test_sharded_checkpoint_round_trips(killed):
    from exactresume.store.sharded import load_sharded

    folder = killed / "resume.dcp"
    assert {path.name for path in folder.iterdir()} == {"__0_0.distcp", "__1_0.distcp", ".metadata", "commit.pth"}
    assert all(
        (folder / f"__{rank}_0.distcp").stat().st_size > 1_000_000 for rank in (0, 1)
    )  # each rank wrote its share
    sharded, single = load_sharded(folder), read_resume_file(killed / "step2.pth")
    assert sharded["step"] == single["step"] == 2 and sharded["config"] == single["config"]
    assert all(torch.equal(sharded["model"][name], single["model"][name]) for name in single["model"])
    assert len(sharded["rng"]["per_rank"]) == 2
    assert torch.equal(sharded["gen_state"], single["gen_state"])
    assert torch.equal(sharded["rng"]["per_rank"][1]["torch"], single["rng"]["per_rank"][1]["torch"])
    assert sharded["rng"]["per_rank"][0]["python"] == single["rng"]["per_rank"][0]["python"]
    # Keyed by parameter name in the folder, by index in the file; param_groups lists both in the same order.
    names, indices = sharded["optimizer"]["param_groups"][0]["params"], single["optimizer"]["param_groups"][0]["params"]
    assert len(names) == len(indices) == len(sharded["optimizer"]["state"])
    for name, index in zip(names, indices):
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sharded["optimizer"]["state"][name][moment], single["optimizer"]["state"][index][moment])


def test_diff_reads_a_sharded_folder(killed):
    finished = call_cli("diff", killed / "resume.dcp", killed / "step2.pth")
    assert finished.returncode == 0 and "max abs difference 0.000e+00: equal" in finished.stdout


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(killed):
    from exactresume.store.sharded import load_sharded, verify_sharded

    staging = killed / "resume.dcp.tmp"
    assert (staging / "__1_0.distcp").read_bytes() == b"the first bytes of a shard"
    assert not (staging / "commit.pth").exists() and not (staging / ".metadata").exists()
    with pytest.raises(CheckpointError, match="no commit marker"):
        load_sharded(staging)
    assert verify_sharded(killed / "resume.dcp")["processes"] == 2
    assert load_sharded(killed / "resume.dcp")["step"] == 2


def test_a_new_save_replaces_the_old_folder_and_clears_a_killed_one(tmp_path, kjv_folder, killed):
    from exactresume.store.sharded import load_sharded

    out = tmp_path / "out"
    shutil.copytree(killed / "resume.dcp", out / "resume.dcp")  # the previous checkpoint, step 2
    shutil.copytree(killed / "resume.dcp.tmp", out / "resume.dcp.tmp")  # what the killed save left
    finished = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--stop-at", 3, "--sharded", "--overwrite")
    assert finished.returncode == 0, finished.stderr
    assert load_sharded(out / "resume.dcp")["step"] == 3
    assert sorted(path.name for path in out.iterdir()) == ["log.csv", "resume.dcp"]


def test_per_rank_state_on_another_number_of_processes():
    class Part:
        def load_state_dict(self, state):
            self.state = state

    saved = {"per_rank": ["rank 0", "rank 1"]}
    for rank, size, expected in [(0, 1, "rank 0"), (1, 2, "rank 1"), (2, 3, "rank 0")]:
        part = Part()
        PerRank(part, World(rank, size)).load_state_dict(saved)
        assert part.state == expected
    part = Part()
    PerRank(part, World(1, 2)).load_state_dict("a single-process state")
    assert part.state == "a single-process state"


def test_lab_passes_the_process_count_to_every_training_run():
    flags = _train_flags(LabConfig(nproc=2))
    assert flags[flags.index("--nproc") + 1] == "2"


# ---- refusals: one line, exit 2 ----------------------------------------------------------------


def resume_sharded(out, data, folder, *flags):
    return call_cli("train", "--out", out, "--data", data, *SMALL, "--resume", folder, *flags)


def copy_of_sharded(killed, tmp_path) -> Path:
    return Path(shutil.copytree(killed / "resume.dcp", tmp_path / "copy.dcp"))


def test_missing_shard_is_refused(tmp_path, kjv_folder, killed):
    folder = copy_of_sharded(killed, tmp_path)
    (folder / "__1_0.distcp").unlink()
    assert_one_line_error(resume_sharded(tmp_path / "out", kjv_folder, folder), "__1_0.distcp", "missing")
    assert not (tmp_path / "out" / "final.pth").exists()


def test_damaged_shard_and_missing_commit_marker_are_refused(tmp_path, kjv_folder, killed):
    folder = copy_of_sharded(killed, tmp_path)
    shard = bytearray((folder / "__0_0.distcp").read_bytes())
    shard[len(shard) // 2] ^= 0x01
    (folder / "__0_0.distcp").write_bytes(bytes(shard))
    assert_one_line_error(resume_sharded(tmp_path / "out", kjv_folder, folder), "__0_0.distcp", "checksum mismatch")
    (folder / "commit.pth").unlink()
    assert_one_line_error(resume_sharded(tmp_path / "out", kjv_folder, folder), "no commit marker")


def test_a_plain_folder_is_read_as_a_checkpoint_store(tmp_path, kjv_folder):
    (tmp_path / "runs").mkdir()
    assert_one_line_error(
        resume_sharded(tmp_path / "out", kjv_folder, tmp_path / "runs"), "runs holds no complete checkpoint"
    )


def test_sharded_checkpoint_of_a_different_model_is_refused(tmp_path, kjv_folder, killed):
    finished = resume_sharded(tmp_path, kjv_folder, killed / "resume.dcp", "--preset", "minimind-26m")
    assert_one_line_error(finished, "different run", "hidden_size")


def test_the_launcher_says_the_ranks_error_once():
    # What torchrun's stderr holds when both ranks refuse a resume (trimmed from a real run).
    stderr = (
        "exactresume train: error: resume.dcp: shard file __1_0.distcp is missing\n"
        * 2
        + "W1129 api.py:1028] Sending process 13475 closing signal SIGTERM\n"
        "E1129 api.py:1002] failed (exitcode: 2) local_rank: 1 (pid: 13476)\nTraceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  exitcode  : 2 (pid: 13476)\n"
    )
    assert first_error(stderr) == "exactresume train: error: resume.dcp: shard file __1_0.distcp is missing"
    assert first_error("Traceback (most recent call last):\nValueError: a bug\n") is None


@pytest.mark.parametrize("command", ["train", "lab"])
def test_batch_not_divisible_by_processes_is_refused(tmp_path, kjv_folder, command):
    finished = call_cli(command, "--out", tmp_path, "--data", kjv_folder, "--batch", 3, "--nproc", 2)
    assert_one_line_error(finished, "--batch 3", "2 processes")


def test_sharded_needs_stop_at(tmp_path, kjv_folder):
    assert_one_line_error(call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--sharded"), "--sharded")


def test_the_agent_is_torchruns_standalone_forking_its_ranks_except_under_the_doctor(monkeypatch, tmp_path):
    monkeypatch.delenv("EXACTRESUME_DOCTOR_TRACE", raising=False)
    config = agent_config(3, tmp_path)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (1, 1, 3, 0)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.start_method) == ("c10d", "localhost:0", "fork")
    assert config.logs_specs.root_log_dir == str(tmp_path)
    monkeypatch.setenv("EXACTRESUME_DOCTOR_TRACE", "1")
    assert agent_config(3, tmp_path).start_method == "spawn"


def test_without_fork_nproc_is_refused_in_one_line(monkeypatch):
    from exactresume.parallel.launch import launch

    monkeypatch.delattr(os, "fork")
    with pytest.raises(UserError, match="--nproc needs a system with fork"):
        launch(print, ["train"], 2)
