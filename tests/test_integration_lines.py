"""Each framework's line (exactresume.integrations) given what it cannot take: one line on stderr saying
what and what to do, and the run left as the framework alone runs it; a damaged state of ours is named
and never trusted. In this process, with the frameworks' own objects (exactness: test_integrations.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from exactresume import accelerate_resume, lightning_resume, trainer_resume
from exactresume.errors import FieldError
from exactresume.integrations.read_through import ReadThrough
from exactresume.integrations.transformers import newest_complete
from exactresume.store.sealed import save_sealed


def data_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)


def lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("exactresume:")]


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_accelerate_takes_the_prepared_loader_only(accelerator, capsys):
    raw = data_loader()
    assert accelerate_resume(accelerator, raw) is raw
    said = lines(capsys)
    assert len(said) == 1 and "takes what accelerator.prepare(loader) returns, got a DataLoader" in said[0], said
    assert "resumes as Accelerate alone resumes it (its saves are still made whole or absent)" in said[0]


def test_accelerate_given_the_loader_twice(accelerator, capsys):
    loader = accelerate_resume(accelerator, accelerator.prepare(data_loader()))
    assert accelerate_resume(accelerator, loader) is loader
    said = lines(capsys)
    assert len(said) == 1 and "given this loader twice; the first call acts and this one does nothing" in said[0], said
    assert isinstance(loader.base_dataloader, ReadThrough)


def test_accelerate_stands_aside_for_its_own_stateful_loader(capsys):
    from accelerate import Accelerator, DataLoaderConfiguration

    stateful = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = stateful.prepare(data_loader())
    assert accelerate_resume(stateful, loader) is loader
    said = lines(capsys)
    assert len(said) == 1 and "use_stateful_dataloader=True" in said[0], said
    assert not isinstance(loader.base_dataloader, ReadThrough)


def test_accelerate_names_a_damaged_state_and_resumes_as_its_own(accelerator, tmp_path, capsys):
    loader = accelerate_resume(accelerator, accelerator.prepare(data_loader()))
    next(iter(loader))
    accelerator.save_state(tmp_path / "step_1")
    state_file = tmp_path / "step_1" / "exactresume-rank0.pt"
    damaged = bytearray(state_file.read_bytes())
    damaged[len(damaged) // 3] ^= 0x10
    state_file.write_bytes(bytes(damaged))
    accelerator.load_state(tmp_path / "step_1")
    said = lines(capsys)
    assert len(said) == 1 and "exactresume-rank0.pt" in said[0] and "this resume is Accelerate's own" in said[0], said


def test_accelerate_saves_nothing_of_a_loader_the_loop_did_not_read_since_load_state(tmp_path, capsys):
    """As after skip_first_batches, whose new loader the loop reads instead: the loaded position is not saved again."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # its own: the module's holds the other tests' loaders
    loader = accelerate_resume(accelerator, accelerator.prepare(data_loader()))
    next(iter(loader))
    accelerator.save_state(tmp_path / "step_1")
    accelerator.load_state(tmp_path / "step_1")
    capsys.readouterr()
    accelerator.save_state(tmp_path / "step_2")
    said = lines(capsys)
    assert len(said) == 1 and "the loop did not read the loader since load_state" in said[0], said
    assert "nothing of it is saved" in said[0] and not (tmp_path / "step_2" / "exactresume-rank0.pt").exists()


def saved_folders(project: Path, line: bool) -> list[str]:
    """What three save_state calls leave under automatic_checkpoint_naming with total_limit=2."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    naming = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=naming)
    loader = accelerator.prepare(data_loader())
    if line:
        loader = accelerate_resume(accelerator, loader)
    for _ in zip(range(3), loader):
        accelerator.save_state()
    return sorted(str(path.relative_to(project)) for path in project.rglob("*") if path.is_dir())


def test_accelerate_saves_whole_folders_where_automatic_naming_puts_them(tmp_path):
    """Each folder staged outside checkpoints/ (whose every entry Accelerate's own load_state takes for a
    checkpoint), renamed into place whole, the oldest beyond total_limit pruned as Accelerate prunes."""
    own = saved_folders(tmp_path / "own", line=False)
    assert own == ["checkpoints", "checkpoints/checkpoint_1", "checkpoints/checkpoint_2"]
    assert saved_folders(tmp_path / "line", line=True) == own


class SaveCount:
    """A state registered for checkpointing: which save a checkpoint holds."""

    def __init__(self):
        self.saves = 0

    def state_dict(self) -> dict[str, int]:
        return {"saves": self.saves}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.saves = state["saves"]


def automatic_naming(project: Path, line: bool):
    """An accelerator saving into `project`/checkpoints under automatic naming (3 kept), its loader, its count."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    naming = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=3)
    accelerator, count = Accelerator(cpu=True, project_config=naming), SaveCount()
    accelerator.register_for_checkpointing(count)
    loader = accelerator.prepare(data_loader())
    return accelerator, accelerate_resume(accelerator, loader) if line else loader, count


def save_three(project: Path, line: bool) -> None:
    accelerator, loader, count = automatic_naming(project, line)
    for _ in zip(range(3), loader):
        count.saves += 1
        accelerator.save_state()


def checkpoint_names(project: Path) -> list[str]:
    return sorted(path.name for path in (project / "checkpoints").iterdir())


@pytest.mark.parametrize("line", [False, True])
def test_accelerate_saves_after_load_state_where_the_uninterrupted_run_saves(tmp_path, line):
    """Accelerate alone counts its saves from 0 again after load_state: the resumed run's save prunes
    checkpoint_0 and takes its name, the lowest, and the next load_state takes an older one instead."""
    save_three(tmp_path, line)
    resumed, loader, count = automatic_naming(tmp_path, line)
    resumed.load_state()
    assert count.saves == 3
    count.saves += 1
    resumed.save_state()
    again, loader, count = automatic_naming(tmp_path, line)
    again.load_state()
    if line:
        assert (count.saves, checkpoint_names(tmp_path)) == (4, ["checkpoint_1", "checkpoint_2", "checkpoint_3"])
    else:  # by hand: the 4th save is lost to the next resume
        assert (count.saves, checkpoint_names(tmp_path)) == (3, ["checkpoint_0", "checkpoint_1", "checkpoint_2"])


def saved_counts(project: Path) -> dict[str, bytes]:
    """Each checkpoint folder's saved SaveCount, as bytes."""
    return {path.parent.name: path.read_bytes() for path in project.glob("checkpoints/*/custom_checkpoint_0.pkl")}


@pytest.mark.parametrize("saves", [3, 5])
def test_accelerate_refuses_a_new_run_among_another_runs_checkpoints_before_pruning(tmp_path, saves):
    """A new run in a used project, without load_state. Accelerate alone (by hand, on a copy) prunes the
    old run's oldest and saves checkpoint_0 where pruning freed it: an old checkpoint is lost, and the
    next load_state takes the old run's newest. With the line the save is refused, and nothing moves."""
    project = tmp_path / "project"
    first, loader, count = automatic_naming(project, line=False)
    for number in range(saves):
        count.saves = number + 1
        first.save_state()
    kept = saved_counts(project)
    shutil.copytree(project, tmp_path / "alone")
    alone, loader, count = automatic_naming(tmp_path / "alone", line=False)
    alone.save_state()
    after = saved_counts(tmp_path / "alone")
    assert [name for name, saved in kept.items() if after.get(name) != saved], "by hand: an old checkpoint is lost"
    again, loader, count = automatic_naming(project, line=True)
    written = f"holds checkpoint_{saves - 1}, at or past checkpoint_0 that this save would write; nothing was"
    with pytest.raises(ValueError, match=written):
        again.save_state()
    assert saved_counts(project) == kept


def test_accelerate_says_at_a_save_that_the_workers_draw(capsys):
    """Random numbers drawn in the loader's workers live there: no checkpoint holds them."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # its own: the module's holds the other tests' loaders
    noisy = DataLoader(NoisyDataset(), batch_size=4, shuffle=True, num_workers=1)
    loader = accelerate_resume(accelerator, accelerator.prepare(noisy))
    for _ in zip(range(2), loader):
        pass
    with tempfile.TemporaryDirectory() as folder:
        accelerator.save_state(folder)
    said = lines(capsys)
    assert len(said) == 1 and "draws random numbers in its workers" in said[0], said


class NoisyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index)) + torch.randn(4)  # the augmentation, drawn in the worker


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (lambda acc: (data_loader(), acc), "takes the Accelerator first, got a DataLoader"),
        (lambda acc: (None, data_loader()), "takes the Accelerator first, got None"),
        (lambda acc: (acc, torch.nn.Linear(2, 2)), "takes the DataLoader accelerator.prepare returned, got a Linear"),
    ],
)
def test_accelerate_line_called_wrong_is_one_line(accelerator, arguments, message):
    with pytest.raises(FieldError, match=f"^accelerate_resume\\(accelerator, loader\\) {message}$"):
        accelerate_resume(*arguments(accelerator))


@pytest.mark.parametrize(("folder", "staged"), [("step_1", ".exactresume-partial/step_1"),
                                               ("ckpt/step_1", ".exactresume-partial/ckpt/step_1")])  # fmt: skip
def test_accelerate_stages_a_save_beside_its_parent_never_above_the_working_directory(
    accelerator, tmp_path, monkeypatch, folder, staged
):
    from exactresume.integrations import accelerate_atomic

    renamed, real = [], accelerate_atomic.replace_folder
    monkeypatch.setattr(accelerate_atomic, "replace_folder", lambda old, new: renamed.append(old) or real(old, new))
    monkeypatch.chdir(tmp_path)
    accelerate_resume(accelerator, accelerator.prepare(data_loader()))
    accelerator.save_state(folder)
    assert renamed == [tmp_path / staged]
    assert (tmp_path / folder / "exactresume-rank0.pt").exists() and not (tmp_path / ".exactresume-partial").exists()


def test_accelerate_staging_survives_another_runs_cleanup_of_the_shared_folder(tmp_path, monkeypatch):
    """Two runs saving under one folder: the other's save, ending, removes the empty `.exactresume-partial`
    between this one's making of it and of its own folder inside (seen in the suite, two resumes at once)."""
    from exactresume.integrations import accelerate_atomic

    staging, real_mkdir, calls = tmp_path / ".exactresume-partial" / "run" / "step_1", Path.mkdir, []

    def mkdir_raced(path, *args, **kwargs):
        calls.append(path)
        if path == staging and len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path))  # the other run's rmdir won
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir_raced)
    accelerate_atomic._make_staging(staging)
    assert staging.is_dir() and calls.count(staging) >= 2


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        loss = (self.linear(x).squeeze(-1) - labels).square().mean()
        return {"loss": loss}


def trainer(tmp_path: Path, **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **arguments)
    return Trainer(model=Tiny(), args=args, train_dataset=[{"x": torch.randn(4), "labels": 0.0}] * 8)


def test_the_trainer_line_on_what_is_not_a_trainer(capsys):
    thing = object()
    assert trainer_resume(thing) is thing
    said = lines(capsys)
    assert len(said) == 1 and "this is not a Trainer it knows" in said[0], said


def test_the_trainer_line_given_twice_or_with_ignore_data_skip(tmp_path, capsys):
    once = trainer(tmp_path / "a")
    assert trainer_resume(trainer_resume(once)) is once
    skipping = trainer(tmp_path / "b", ignore_data_skip=True)
    assert trainer_resume(skipping) is skipping
    said = lines(capsys)
    assert len(said) == 2, said
    assert "given this Trainer twice; the first call acts and this one does nothing" in said[0]
    assert "ignore_data_skip=True" in said[1] and "the run goes on as the Trainer alone runs it" in said[1]
    assert not hasattr(skipping, "_exactresume")


def test_the_newest_whole_checkpoint_passes_over_a_damaged_state(tmp_path, capsys):
    for step in (1, 2, 3):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if step != 3:  # checkpoint-3: cut short before trainer_state.json
            (folder / "trainer_state.json").write_text("{}")
        save_sealed(folder / "exactresume-rank0.pt", {"step": step})
    state_file = tmp_path / "checkpoint-2" / "exactresume-rank0.pt"
    damaged = bytearray(state_file.read_bytes())
    damaged[40] ^= 0x01
    state_file.write_bytes(bytes(damaged))
    assert newest_complete(tmp_path, "exactresume-rank0.pt") == str(tmp_path / "checkpoint-1")
    said = lines(capsys)
    assert len(said) == 2, said
    assert "checkpoint-3 is not a whole checkpoint (its trainer_state.json is missing" in said[0]
    assert "checkpoint-2 is not a whole checkpoint" in said[1] and "checksum" in said[1]
    assert state_file.read_bytes() == bytes(damaged)  # left as it is


class Regression:
    """A LightningModule over one loader or two (made with the Lightning in use)."""

    @staticmethod
    def make(loaders):
        import pytorch_lightning as pl

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_index):
                inputs = batch[0][0] if isinstance(batch, list) and isinstance(batch[0], list) else batch[0]
                return self.net(inputs).square().mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                return loaders

        return Module()


def fit(tmp_path: Path, loaders, callbacks) -> None:
    import pytorch_lightning as pl

    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    pl.Trainer(max_steps=3, callbacks=callbacks, accelerator="cpu", default_root_dir=tmp_path, **quiet).fit(
        Regression.make(loaders)
    )


def test_lightning_with_two_training_loaders_stands_aside(tmp_path, capsys):
    fit(tmp_path, [data_loader(), data_loader()], [lightning_resume()])
    said = lines(capsys)
    assert len(said) == 1 and "resumes one training DataLoader" in said[0], said
    assert "the run goes on as Lightning alone runs it" in said[0]


def test_lightning_given_the_callback_twice(tmp_path, capsys):
    fit(tmp_path, data_loader(), [lightning_resume(), lightning_resume()])
    said = lines(capsys)
    assert len(said) == 1 and "it is given twice; the first one acts and this one does nothing" in said[0], said
