"""The Hugging Face Trainer: one call on the Trainer makes `train(resume_from_checkpoint=True)` exact.

    trainer = trainer_resume(Trainer(model=model, args=args, train_dataset=dataset))
    trainer.train(resume_from_checkpoint=True)

The Trainer resumes mid-epoch by building a second loader that leaves out the batches the loop took
(reading every one of them for an IterableDataset) and sets the RNG back only after that loader has
fetched its first batch, so what that fetch and its workers' seed drew comes out otherwise (a masking
collator masks other tokens). With this line the Trainer's own loader is read through a
ResumableLoader (shard.py): at a resume it opens at the first batch the loop did not take, reading none
before it, and the global RNG is set back as the uninterrupted run had it at each fetch after the save
(loop_state.py); the Trainer's own later restore of the RNG is left out, and its skip finds the loader
already in place. Each process writes its state beside the Trainer's RNG file in the checkpoint folder
(`exactresume-rank0.pt`, sealed); the folder stays the Trainer's, and a Trainer without this line
resumes it as it always has.

It works on the Trainer instance (a subclass's too: SFTTrainer and the like), through its public
`train` and `get_train_dataloader`, its `_save_rng_state` and `_load_rng_state`, and the
`skip_first_batches` the Trainer's module calls, which it leaves as it was for every other loader.
"""

from __future__ import annotations

import sys
from pathlib import Path

from exactresume.errors import CheckpointError, UserError, notice
from exactresume.store.sealed import load_sealed, save_sealed

from . import shard as shards
from .loop_state import LoopState
from .read_through import ReadThrough

NAME = "trainer_resume"
SUPPORTED = "4.46"  # the oldest Trainer whose loop skips with accelerate's skip_first_batches and these methods
USED = ("train", "get_train_dataloader", "_save_rng_state", "_load_rng_state")
INSTALLED = "_exactresume"
PREFIX = "checkpoint-"  # the Trainer's checkpoint folders: checkpoint-STEP


def trainer_resume(trainer):
    """`trainer`, whose checkpoints now resume exactly; a line, and the Trainer as it was, where they cannot."""
    try:
        _check(trainer)
    except UserError as error:
        twice = "twice" in str(error)
        notice(f"{NAME}: {error}" + ("" if twice else "; the run goes on as the Trainer alone runs it"))
        return trainer
    _TrainerHooks(trainer)
    return trainer


def _check(trainer) -> None:
    if getattr(trainer, INSTALLED, None) is not None:
        raise UserError("it is given this Trainer twice; the first call acts and this one does nothing")
    module = sys.modules.get(type(trainer).__module__)
    trainer_module = sys.modules.get("transformers.trainer")
    missing = [name for name in USED if not callable(getattr(trainer, name, None))]
    if trainer_module is None or not hasattr(trainer_module, "skip_first_batches") or missing or module is None:
        raise UserError(f"this is not a Trainer it knows (it supports transformers {SUPPORTED} on)")
    if trainer.args.ignore_data_skip:
        raise UserError(
            "ignore_data_skip=True has the Trainer start a resumed epoch from its first batch; "
            "without it, this resume reads none of the batches it leaves out"
        )


class _TrainerHooks:
    """What `trainer_resume` puts on one Trainer instance."""

    def __init__(self, trainer):
        self.trainer, self.state, self.shard = trainer, None, None
        self.checkpoint: str | None = None  # the folder this train() resumes from
        self.loaded = False  # our state of that folder is in the loader: the Trainer's own restore is left out
        self.train, self.get_train_dataloader = trainer.train, trainer.get_train_dataloader
        self.save_rng_state, self.load_rng_state = trainer._save_rng_state, trainer._load_rng_state
        trainer.train, trainer.get_train_dataloader = self._train, self._get_train_dataloader
        trainer._save_rng_state, trainer._load_rng_state = self._save_rng_state, self._load_rng_state
        setattr(trainer, INSTALLED, self)
        _skip_in_place(sys.modules["transformers.trainer"])

    def _train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # as train() itself finds it, less a checkpoint cut short
            resume_from_checkpoint = newest_complete(Path(self.trainer.args.output_dir), self._state_file)
            if resume_from_checkpoint is None:  # the Trainer's own error for it
                return self.train(True, *args, **kwargs)
        self.checkpoint, self.loaded = resume_from_checkpoint or None, False
        return self.train(resume_from_checkpoint, *args, **kwargs)

    def _get_train_dataloader(self):
        shard = self.get_train_dataloader()
        try:
            self.state, self.shard = shards.read_through(shard), shard
        except UserError as error:
            notice(f"{NAME}: {error}; the run goes on as the Trainer alone runs it")
            self.state = None
            return shard
        if self.checkpoint is not None:
            self._load(Path(self.checkpoint))
        return shard

    @property
    def _state_file(self) -> str:
        return shards.state_file(self.trainer.args.process_index)

    def _load(self, folder: Path) -> None:
        path = folder / self._state_file
        if not path.exists():
            notice(
                f"{NAME}: {folder} was saved without it, so this run resumes and goes on as the Trainer alone runs it "
                "(a run started with it resumes exactly)"
            )
            self._stand_aside()
            return
        try:
            self.state.load_state_dict(load_sealed(path))
        except CheckpointError as error:
            notice(f"{NAME}: {error}; this run resumes and goes on as the Trainer alone runs it")
            self._stand_aside()
            return
        shards.set_epoch(self.shard, self.state)
        self.loaded = True

    def _stand_aside(self) -> None:
        """The Trainer's own loader and resume for the rest of this run: a position it did not follow is not saved."""
        shards.stand_aside(self.shard, self.state)

    def _save_rng_state(self, output_dir: str) -> None:
        self.save_rng_state(output_dir)
        if self.state is not None and not self.state.off:
            save_sealed(Path(output_dir) / self._state_file, self.state.state_dict(shards.taken(self.state)))

    def _load_rng_state(self, checkpoint) -> None:
        # Ours sets the RNG at the fetches after the save, or before the next epoch; once it stood aside, the Trainer's.
        if not self.loaded or self.state is None or self.state.off:
            self.load_rng_state(checkpoint)


def newest_complete(output_dir: Path, state_file: str) -> str | None:
    """The newest checkpoint folder the Trainer finished writing, whose state of ours verifies where it has one.

    The Trainer writes a checkpoint's files into its folder one by one, trainer_state.json near the last
    (ours before it): a process killed meanwhile leaves a folder the Trainer's own resume would take and
    fail on, or load half of. Such a folder is named, left as it is, and passed over."""
    numbered = [(int(path.name[len(PREFIX) :]), path) for path in output_dir.glob(f"{PREFIX}*") if _numbered(path)]
    for _, folder in sorted(numbered, reverse=True):
        why = _incomplete(folder, state_file)
        if why is None:
            return str(folder)
        notice(f"{NAME}: {folder} is not a whole checkpoint ({why}); it is left as it is, and an older one is resumed")
    return None


def _numbered(path: Path) -> bool:
    return path.is_dir() and path.name[len(PREFIX) :].isdigit()


def _incomplete(folder: Path, state_file: str) -> str | None:
    if not (folder / "trainer_state.json").is_file():
        return "its trainer_state.json is missing: its save was cut short"
    if (folder / state_file).exists():
        try:
            load_sealed(folder / state_file)
        except CheckpointError as error:
            return str(error)
    return None


def _skip_in_place(trainer_module) -> None:
    """The Trainer's module's skip_first_batches, given a loader of ours that resumes itself, returns it as it is."""
    original = trainer_module.skip_first_batches
    if getattr(original, INSTALLED, False):
        return

    def skip_first_batches(dataloader, num_batches=0):
        base = getattr(dataloader, "base_dataloader", None)
        if isinstance(base, ReadThrough):
            if _resumes_itself(base.loop_state, num_batches):
                return dataloader
            shards.stand_aside(dataloader, base.loop_state)
        return original(dataloader, num_batches)

    setattr(skip_first_batches, INSTALLED, True)
    trainer_module.skip_first_batches = skip_first_batches


def _resumes_itself(state: LoopState, num_batches: int) -> bool:
    """Whether the loader opens `num_batches` in, at a loaded position; else a line: the Trainer's count stands."""
    position = state.loader.position
    if state.loader.resuming and position.consumed == num_batches:
        return True
    iterable = state.loader.iterable
    notice(
        f"{NAME}: the Trainer would leave out {num_batches} batches of the epoch it resumes, and the loop had taken "
        f"{position.consumed} of the loader's epoch {position.epoch}"
        + (
            " (the Trainer counts an IterableDataset's batches from the run's start, across its passes)"
            if iterable
            else ""
        )
        + "; this run resumes and goes on as the Trainer alone runs it"
    )
    return False
