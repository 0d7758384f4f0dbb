"""This process's place among the run's processes: rank, size, and the few collectives every layer
may use (gather, barrier, any, agree). Nothing here wraps a model: DDP and FSDP live in `exactresume.parallel`.
torch is imported only by the collectives, so a command can ask for its rank before paying for torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from exactresume.errors import FieldError, UserError, a_kind_of


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes (rank 0 of 1 when alone)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        """The world torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK, or one process."""
        if not launched_by_torchrun():
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes files."""
        return self.rank == 0

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order, on every rank (picklable values)."""
        if self.size == 1:
            return [value]
        values: list = [None] * self.size
        self._group().all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.size > 1:
            self._group().barrier()

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank (a preemption signal one rank saw)."""
        if self.size == 1:
            return flag
        import torch

        dist = self._group()
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def agree(self, value: int) -> bool:
        """True on every rank when every rank gave the same `value` (|value| < 2**62), in one collective."""
        if self.size == 1:
            return True
        import torch

        dist = self._group()
        extremes = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the largest value, and minus the smallest
        return int(extremes[0]) == -int(extremes[1])

    def _group(self) -> Any:
        """torch.distributed, once its process group is up: every rank of this world calls each collective."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise UserError(
                f"rank {self.rank} of {self.size} processes, but torch.distributed has no process group: "
                "call torch.distributed.init_process_group() first"
            )
        return dist


def given_world(world: object, default: World) -> World:
    """`world` when it is a World, `default` when it is None; else a one-line FieldError."""
    if world is None:
        return default
    if not isinstance(world, World):
        raise FieldError(f"world must be an exactresume.World, got {a_kind_of(world)}", "world")
    if not all(isinstance(number, int) for number in (world.rank, world.size)) or not 0 <= world.rank < world.size:
        raise FieldError(
            f"world is rank {world.rank!r} of {world.size!r}: a world is 1 process or more, each rank 0 to size - 1 "
            "(World.from_env() reads the ranks torchrun started)",
            "world",
        )
    return world
