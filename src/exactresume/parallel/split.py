"""How a global batch is shared by N processes: the arithmetic every mode's split must satisfy.

A train job checks it when it is made (training/job.py), on the launcher before it starts N processes
and on every rank, so a hand-started torchrun meets the same line. This file does not import torch.
"""

from __future__ import annotations

from exactresume.errors import UserError


def _check_batch_split(batch: int, nproc: int, grad_accum: int = 1) -> None:
    """Refuse a global batch that N processes (and their micro-batches) cannot share evenly."""
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if batch % nproc:
        raise UserError(f"--batch {batch} is not divisible by {nproc} processes; the global batch is split evenly")
    if grad_accum >= 1 and (batch // nproc) % grad_accum:  # grad_accum < 1 is TrainConfig's refusal
        raise UserError(
            f"--batch {batch} on {nproc} processes leaves {batch // nproc} sequences per process, "
            f"not a multiple of --grad-accum {grad_accum}"
        )


def allowed_process_counts(micro_batches: int) -> list[int]:
    """The N a step of `micro_batches` micro-batches can run on: one process, or N blocks of 2^k micro-batches."""
    return [
        n
        for n in range(1, micro_batches + 1)
        if n == 1 or (micro_batches % n == 0 and _power_of_two(micro_batches // n))
    ]


def check_process_count(micro_batch: int, nproc: int, rows: int) -> None:
    """Refuse an N that would change the order of the tree's additions over a batch of `rows` sequences."""
    count = rows // micro_batch
    if nproc not in allowed_process_counts(count):
        allowed = ", ".join(map(str, allowed_process_counts(count)))
        raise UserError(
            f"--micro-batch {micro_batch}: a batch of {rows} sequences makes {count} micro-batches, "
            f"which {nproc} processes cannot share in power-of-two blocks; use --nproc {allowed}"
        )


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def check_split(batch: int, nproc: int, grad_accum: int = 1, micro_batch: int = 0) -> None:
    """The batch splits over `nproc` processes as the run's mode needs (a job's check, training/job.py)."""
    if micro_batch:
        check_process_count(micro_batch, nproc, batch)
    else:
        _check_batch_split(batch, nproc, grad_accum)
