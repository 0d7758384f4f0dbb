"""PyTorch Lightning: one callback makes the checkpoints ModelCheckpoint writes resume exactly.

    trainer = Trainer(callbacks=[ModelCheckpoint(every_n_train_steps=100), lightning_resume()])
    trainer.fit(model, datamodule, ckpt_path="last")

Lightning restarts a mid-epoch resume at the epoch's first batch unless the loader has `state_dict()`,
and keeps no RNG. The callback reads each training loader through a ResumableLoader (put in place as
Lightning's fit loop builds its loaders, before their first batch is fetched), and keeps the loader's
position as the loop took it and the RNG (loop_state.py) in the checkpoint, under the callback's own
key: every rank's, gathered to the rank that writes. A checkpoint stays Lightning's own: Lightning
without the callback resumes it as it always has. It also makes Lightning's writes atomic
(lightning_atomic.py): a kill while one is written leaves the last good checkpoint as it was.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Any

import torch

from exactresume.errors import UserError, notice
from exactresume.loaders.resumable import ResumableLoader, set_sampler_epoch

from .lightning_atomic import atomic_io
from .loop_state import LoopState
from .read_through import ReadThrough
from .seal import opened, sealed

NAME = "lightning_resume"
STATE_KEY = "exactresume"  # the first callback's in a process; Lightning refuses two of one key in a Trainer
INSTALLED = "_exactresume_installed"  # set on the fit loop: the callback given twice acts once
SUPPORTED = "2.1"  # the oldest Lightning whose fit loop builds its loaders this way (tested: constraints.txt)
# Lightning says this of a loader without state_dict(); the callback restores the position itself.
NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def lightning_resume():
    """The callback: `Trainer(callbacks=[..., lightning_resume()])`, for `lightning` or `pytorch_lightning`."""
    return _callback_class(_callback_base())()


def _callback_base() -> type:
    """The Callback class of the Lightning the script uses: `lightning.pytorch`'s or `pytorch_lightning`'s."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name].Callback
    try:
        import lightning.pytorch as package
    except ImportError:
        try:
            import pytorch_lightning as package
        except ImportError:
            raise UserError(f"{NAME}() needs Lightning: pip install lightning") from None
    return package.Callback


_CLASSES: dict[type, type] = {}
_MADE = itertools.count()  # callbacks made in this process: each has a key of its own


def _callback_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type("ExactResume", (_Hooks, base), {})
    return _CLASSES[base]


class _Hooks:
    """The callback's hooks; its class is made with the Callback of the Lightning in use."""

    def __init__(self):
        self.loops: list[LoopState] = []
        self.pending: list[dict] | None = None  # loaded, for the loaders the fit loop is about to build
        self.taken = 0  # batches the loop has taken of the loader's current iteration
        self.counted = 1  # the loader's iteration they are counted in
        self.off = False  # the callback stands aside; the run is Lightning's own
        self.before_validation: torch.Tensor | None = None  # torch's RNG at the last training batch's end
        made = next(_MADE)
        self.key = STATE_KEY if made == 0 else f"{STATE_KEY}-{made + 1}"

    @property
    def state_key(self) -> str:
        return self.key

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.off:
            return
        fit_loop = trainer.fit_loop
        load_states = getattr(fit_loop, "_load_combined_loader_states", None)
        if load_states is None or not hasattr(fit_loop, "_combined_loader"):
            self._stand_aside(f"this Lightning's fit loop is not one it knows (it supports Lightning {SUPPORTED} on)")
            return
        if getattr(fit_loop, INSTALLED, False):
            self.off, self.loops, self.pending = True, [], None
            notice(f"{NAME}: it is given twice; the first one acts and this one does nothing")
            return

        def install_then_load() -> None:  # in setup_data, once the loaders are built, before their first fetch
            self._install(trainer)
            load_states()

        fit_loop._load_combined_loader_states = install_then_load
        setattr(fit_loop, INSTALLED, True)
        trainer.strategy.checkpoint_io = atomic_io(trainer.strategy.checkpoint_io)

    def _install(self, trainer) -> None:
        combined = trainer.fit_loop._combined_loader
        if combined is None or self.off:
            return
        loaders = combined.flattened
        if len(loaders) != 1 or not isinstance(loaders[0], torch.utils.data.DataLoader):
            kinds = ", ".join(type(loader).__name__ for loader in loaders)
            self._stand_aside(f"it resumes one training DataLoader, and this run trains on {kinds}")
            return
        if isinstance(loaders[0], ReadThrough):
            return
        try:
            state = LoopState(ResumableLoader(loaders[0]))
            self.taken, self.counted = 0, state.iterations + 1  # the iteration Lightning begins next
            if self.pending is not None:
                state.load_state_dict(self.pending[0])
                self.taken = int(self.pending[0]["loader"]["consumed"])
                warnings.filterwarnings("ignore", message=NOT_RESUMABLE)
        except UserError as error:
            self._stand_aside(str(error))
            return
        finally:
            self.pending = None
        # The loader is fetched from before Lightning sets a DistributedSampler's epoch for the epoch it
        # begins: set as Lightning will, now (a resumed mid-epoch position sets its own as it opens).
        epoch = trainer.fit_loop.epoch_progress.current.processed
        set_sampler_epoch(loaders[0], epoch + 1 if state.rng_now is not None else epoch)
        self.loops = [state]
        combined.flattened = [ReadThrough(state)]

    # Lightning saves a step's checkpoint before that step's validation runs, and a resume does not run it
    # again: what validation draws from torch's RNG (its loaders' worker seeds, drawn before any validation
    # hook) is set back to where the last training batch left it, so training draws as if it had not run.
    def on_validation_end(self, trainer, pl_module) -> None:
        if self.before_validation is not None:
            torch.set_rng_state(self.before_validation)
            self.before_validation = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.before_validation = torch.get_rng_state() if self.loops else None
        # Counted here, not from batch_idx: Lightning's count goes on across a resume its loader restarted.
        if self.loops and self.loops[0].iterations != self.counted:
            self.taken, self.counted = 0, self.loops[0].iterations
        self.taken += 1

    def state_dict(self) -> dict[str, Any]:
        if self.off or not self.loops:
            return {}
        try:
            mine = sealed([loop.state_dict(self.taken) for loop in self.loops])
        except UserError as error:
            self._stand_aside(f"cannot save the loader's position ({error})")
            return {}
        return {"ranks": _gathered(mine)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read in on_load_checkpoint instead: under whichever callback's key it was saved."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if self.off:
            return
        saved = [state for key, state in checkpoint.get("callbacks", {}).items() if key.startswith(STATE_KEY) and state]
        if not saved:
            notice(
                f"{NAME}: this checkpoint was saved without it, so it resumes as Lightning resumes it: "
                "a mid-epoch one from the epoch's first batch, with the RNG as this process has it; "
                "checkpoints saved from now on resume exactly"
            )
            return
        try:
            ranks = saved[0]["ranks"]
            rank, world = _rank_and_world()
            if len(ranks) != world:
                raise UserError(f"the checkpoint was saved by {len(ranks)} processes and this run has {world}")
            self.pending = opened(ranks[rank], "the checkpoint's exactresume state")
        except (UserError, KeyError, TypeError) as error:
            self._stand_aside(f"cannot resume from this checkpoint's state ({error})")

    def _stand_aside(self, why: str) -> None:
        self.off, self.loops, self.pending = True, [], None
        notice(f"{NAME}: {why}; the run goes on as Lightning alone runs it")


def _rank_and_world() -> tuple[int, int]:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)


def _gathered(mine: dict) -> list[dict]:
    """Every rank's state, in rank order (the rank that writes the checkpoint keeps them all)."""
    rank, world = _rank_and_world()
    if world == 1:
        return [mine]
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, mine)
    return every
