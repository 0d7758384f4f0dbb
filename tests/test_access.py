"""The store's one way in (`open_resume`), every source kind, from every way out: `save_resume` and a store's `save`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from exactresume.config import TrainConfig
from exactresume.core.data import load_tokens
from exactresume.errors import CheckpointError, UserError
from exactresume.store.access import AUTO, load_resume, open_resume, save_resume
from exactresume.store.layout import checkpoint_name
from exactresume.store.numbered import CheckpointStore
from exactresume.store.weights import save_weights
from exactresume.training.loop import build_run, train
from exactresume.world import World
from helpers import SMALL, call_cli

CONFIG = TrainConfig(steps=8, batch=2, seq_len=16, preset="tiny")  # the run SMALL's flags describe


def refuse(message: str) -> None:
    raise AssertionError(f"nothing should be skipped: {message}")


@pytest.fixture(scope="module")
def run(kjv_folder):
    """A run trained to step 3, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = build_run(CONFIG, load_tokens(kjv_folder))
    train(run, until=3)
    yield run
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved(run, tmp_path_factory) -> dict[str, Path]:
    """The run's state at step 3 written by each writer, named by the source it gives open_resume."""
    folder = tmp_path_factory.mktemp("access")
    for background in (False, True):
        with CheckpointStore(folder / ("background" if background else "store"), background=background) as store:
            store.save(3, run.parts())
    save_resume(folder / "resume.pth", run.parts(), 3)
    save_resume(folder / "resume.dcp", run.parts(), 3, sharded=True)
    kinds = ("store", "background", "resume.pth", "resume.dcp")
    return dict(zip(("store", "background", "file", "sharded"), (folder / kind for kind in kinds), strict=True))


def test_a_store_takes_its_options_once_and_only_rank_0_runs_a_writer_thread(tmp_path):
    assert CheckpointStore(tmp_path / "a").writer is None
    assert CheckpointStore(tmp_path / "b", background=True).writer is not None
    assert CheckpointStore(tmp_path / "c", background=True, world=World(1, 2)).writer is None
    mistakes = {
        "copy= says how a background save copies": lambda: CheckpointStore(tmp_path, copy="during-next-step"),
        "background must be True or False": lambda: CheckpointStore(tmp_path, background="yes"),
        "copy must be 'before-return' or 'during-next-step'": lambda: CheckpointStore(
            tmp_path, background=True, copy="overlap"
        ),
        "world must be an exactresume.World": lambda: CheckpointStore(tmp_path, world=2),
        "world must be an exactresume.World, got an int": lambda: save_resume(tmp_path / "r.pth", {}, 1, world=2),
        "world must be an exactresume.World, got a str": lambda: load_resume(tmp_path / "r.pth", {}, world="x"),
        r"world is rank 3 of 2: a world is 1 process or more, each rank 0 to size - 1": lambda: CheckpointStore(
            tmp_path, world=World(3, 2)
        ),
        r"world is rank 0 of 0": lambda: CheckpointStore(tmp_path, world=World(0, 0)),
        r"world is rank -1 of 2": lambda: save_resume(tmp_path / "r.pth", {}, 1, world=World(-1, 2)),
        "rank 1 of 2 processes, but torch.distributed has no process group": lambda: CheckpointStore(
            tmp_path, world=World(1, 2)
        ).save(1, {"model": torch.nn.Linear(1, 1)}),
    }
    for line, mistake in mistakes.items():
        with pytest.raises(UserError, match=line):
            mistake()


@pytest.mark.parametrize(
    "writer, kind", [("file", "file"), ("store", "store"), ("background", "store"), ("sharded", "sharded")]
)
def test_every_source_gives_back_the_state_it_was_saved_with(run, saved, kjv_folder, writer, kind):
    resumed = open_resume(saved[writer], notify=refuse)
    assert (resumed.kind, resumed.step, resumed.saved_world_size) == (kind, 3, 1)
    assert resumed.path == (saved[writer] / checkpoint_name(3) if kind == "store" else saved[writer])
    fresh = build_run(CONFIG, load_tokens(kjv_folder))
    resumed.restore(fresh.parts())
    assert fresh.step.value == 3
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    for index, moments in run.optimizer.state_dict()["state"].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][index]["exp_avg"], moments["exp_avg"])
    assert torch.equal(fresh.batches.state_dict(), run.batches.state_dict())


def test_auto_opens_the_runs_own_folder_or_starts_fresh(saved, tmp_path):
    assert open_resume(AUTO, checkpoints=saved["store"], notify=refuse).path == saved["store"] / checkpoint_name(3)
    assert open_resume(AUTO, checkpoints=tmp_path / "never-made", notify=refuse) is None
    (tmp_path / "empty").mkdir()
    assert open_resume(AUTO, checkpoints=tmp_path / "empty", notify=refuse) is None
    # A folder whose only checkpoint is damaged is no empty folder: a run started fresh there trains over it.
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / checkpoint_name(5)).write_bytes(b"the first bytes of a checkpoint")
    with pytest.raises(CheckpointError) as refused:
        open_resume(AUTO, checkpoints=tmp_path / "damaged", notify=refuse)
    line = str(refused.value)
    assert "cannot be loaded" in line and checkpoint_name(5) in line and "move the checkpoints out" in line, line
    assert "\n" not in line
    with pytest.raises(UserError, match="checkpoint folder"):
        open_resume(AUTO)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def damaged_source(saved: dict[str, Path], run, folder: Path, damage: str) -> Path:
    if damage in ("flipped file", "damaged store"):
        source = Path(shutil.copytree(saved["store"], folder / "store"))
        flip_a_byte(source / checkpoint_name(3))
        return source / checkpoint_name(3) if damage == "flipped file" else source
    if damage == "weights file":
        save_weights(folder / "final.pth", run.model.state_dict())
        return folder / "final.pth"
    if damage == "empty folder":
        (folder / "runs").mkdir()
        return folder / "runs"
    source = Path(shutil.copytree(saved["sharded"], folder / "copy.dcp"))
    if damage == "uncommitted sharded":
        (source / "commit.pth").unlink()
    else:
        flip_a_byte(source / "__0_0.distcp")
    return source


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flipped file", "checksum mismatch"),
        ("weights file", "a weights file, not a resume file"),
        ("empty folder", "holds no complete checkpoint"),
        ("damaged store", "holds no complete checkpoint; skipping damaged checkpoint"),
        ("uncommitted sharded", "no commit marker"),
        ("damaged shard", "__0_0.distcp is damaged (checksum mismatch)"),
    ],
)
def test_a_damaged_source_is_refused_in_one_line(saved, run, tmp_path, damage, reason):
    source = damaged_source(saved, run, tmp_path, damage)
    with pytest.raises(CheckpointError) as refused:
        open_resume(source, notify=refuse)
    message = str(refused.value)
    assert reason in message and str(source) in message and "\n" not in message


def test_train_resumes_from_a_checkpoint_folder(saved, tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--resume", saved["store"])
    assert finished.returncode == 0, finished.stderr
    assert f"resumed from {saved['store'] / checkpoint_name(3)} at step 3" in finished.stdout
    steps = [line.split(",")[0] for line in (tmp_path / "log.csv").read_text().splitlines()[1:]]
    assert steps == ["4", "5", "6", "7", "8"]


def test_a_ranks_save_without_world_under_torchrun_says_once_what_it_keeps(tmp_path, monkeypatch, capsys):
    from exactresume.parts import GlobalRng

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for step in (1, 2):
        save_resume(tmp_path / "resume.pth", {"model": torch.nn.Linear(1, 1), "rng": GlobalRng()}, step)
    said = [line for line in capsys.readouterr().err.splitlines() if "without world=" in line]
    assert said == [
        "exactresume: rank 1 of 2 saves rng without world=: the file keeps this rank's state of them only; "
        "give world=World.from_env() on every rank to keep each rank's"
    ]


def test_a_resume_file_the_storage_refuses_is_one_line_and_the_old_file_stays(tmp_path):
    from exactresume.errors import StorageError
    from exactresume.parts import StepCounter

    (tmp_path / "resume.pth").write_bytes(b"what was there")
    (tmp_path / "resume.pth.tmp").mkdir()  # where the new bytes would go: the write is refused there
    with pytest.raises(StorageError, match=r"^could not write .*resume\.pth: .*; what was there before is intact$"):
        save_resume(tmp_path / "resume.pth", {"step": StepCounter()}, step=1)
    assert (tmp_path / "resume.pth").read_bytes() == b"what was there"
