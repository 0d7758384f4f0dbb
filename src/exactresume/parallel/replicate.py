"""Which replica a rank runs: one process, DDP, FSDP2 (`--shard fsdp`) or the N-independent mode.

`replicate(run, world)` swaps the run's one-process replica for the one its config asks for. That the
run's batches split over N as its mode needs was checked when its job was made (training/job.py),
for the launcher and a hand-started torchrun alike.
"""

from __future__ import annotations

from exactresume.core.epochs import EpochLoader
from exactresume.errors import UserError
from exactresume.parallel.exact import ExactReplicas
from exactresume.parallel.replicas import Replicas
from exactresume.parallel.split import check_process_count
from exactresume.world import World


def replicate(run, world: World) -> None:
    """Make `run` this rank's replica: its share of each global batch (N-independent with --micro-batch)."""
    config = run.config
    if config.micro_batch:
        _check_exact_epoch_end(run, world.size)
    if world.size == 1:
        return  # FSDP2 over one rank is the plain model: nothing to wrap
    if run.device.type != "cpu":
        raise UserError(
            f"--device {run.device.type} with --nproc {world.size}: many processes run on the CPU (gloo) only"
        )
    if config.micro_batch:
        run.replicas = ExactReplicas(run.model, world)
        return
    remainder = _epoch_remainder(run)
    if remainder % world.size:
        raise UserError(_uneven_epoch_end(remainder, len(run.batches.dataset), world.size))
    if config.fsdp:
        from exactresume.parallel.fsdp import ShardedReplicas  # FSDP2 costs half a second to import

        run.replicas = ShardedReplicas(run.model, run.optimizer, world)
    else:
        run.replicas = Replicas(run.model, world)


def _uneven_epoch_end(remainder: int, sequences: int, nproc: int) -> str:
    """The refusal of an epoch whose last batch N processes cannot share, with what would let them."""
    said = f"--loader epoch: each epoch ends with a batch of {remainder} sequences, not divisible by {nproc} processes"
    if sequences % nproc == 0:
        return f"{said}; choose another --batch"
    # A batch divisible by N leaves as many over as the epoch's sequences do, modulo N: no --batch helps
    return (
        f"{said}, whatever the --batch: the epoch holds {sequences} sequences; choose a --seq-len that makes "
        f"their number divisible by {nproc}, or another --loader"
    )


def _epoch_remainder(run) -> int:
    """The sequences of the short batch that ends each epoch (0 for random windows or whole batches)."""
    return len(run.batches.dataset) % run.batches.batch if isinstance(run.batches, EpochLoader) else 0


def _check_exact_epoch_end(run, nproc: int) -> None:
    """The short last batch of an epoch, when the run reaches one, splits over N as the full batches do."""
    config = run.config
    remainder = _epoch_remainder(run)
    if remainder and config.steps * config.batch >= len(run.batches.dataset):  # the run reaches an epoch's end
        if remainder % config.micro_batch:
            raise UserError(
                f"--loader epoch: each epoch ends with a batch of {remainder} sequences, not a multiple of "
                f"--micro-batch {config.micro_batch}; choose another --batch or --micro-batch"
            )
        check_process_count(config.micro_batch, nproc, remainder)
