"""The N-independent mode (`--micro-batch B`): a run whose bits do not depend on the number of processes.

Floating-point addition is not associative, so DDP's gradient, summed over ranks in an order that
depends on N, differs in its last bits between N = 1, 2 and 4, and every later step carries that on.
Here the unit of work is fixed instead: the global batch is cut into M micro-batches of B sequences,
each micro-batch's gradient is computed alone (the same kernels on the same shapes, whichever rank
runs it), and the M gradients are added along one binary tree over the micro-batch index:

    leaves 0..M-1 -> pairs (0+1) (2+3) ... -> quadruples ... -> one sum

Rank r of N computes the contiguous block of M/N micro-batches starting at r * M/N. When M/N is a
power of two each block is a whole subtree, so a rank adds its block locally, the ranks all-gather
their block sums, and every rank finishes the same tree over the N block sums: N decides who
computes which leaf, never the order of any addition. Hence the rule on N: it divides M and M/N is
a power of two (N = 1 always works). Dropout masks come from a generator seeded by
(seed, step, micro-batch index), not from a rank's stream, and clipping sees the whole gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from exactresume.config import TrainConfig
from exactresume.core.batches import Batch
from exactresume.world import World

# (inputs, targets, share of the global batch, micro-batch index) -> the micro-batch's loss; its
# backward leaves the micro-batch's gradient (times share) in the parameters' .grad.
MicroStep = Callable[[torch.Tensor, torch.Tensor, float, int], float]


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch `index`'s random draws (dropout) at 0-based optimizer `step`."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1, np.uint64)[0])


class TreeSum:
    """Adds vectors along the binary tree over their arrival order, holding O(log count) of them.

    Two partial sums are added as soon as they cover equal, aligned halves (like a binary counter);
    at the end the remaining ones, largest first, are folded from the right. The result is a pure
    function of the leaf values and their number, so any grouping of aligned power-of-two blocks
    gives the same bits.
    """

    def __init__(self) -> None:
        self.stack: list[tuple[int, torch.Tensor]] = []  # (leaves covered, their sum)

    def add(self, vector: torch.Tensor, leaves: int = 1) -> None:
        while self.stack and self.stack[-1][0] == leaves:
            covered, left = self.stack.pop()
            vector, leaves = left + vector, covered + leaves
        self.stack.append((leaves, vector))

    def result(self) -> torch.Tensor:
        leaves, total = self.stack[-1]
        for _, left in reversed(self.stack[:-1]):
            total = left + total
        return total


class ExactReplicas:
    """This process's share of a step in the N-independent mode (any N, one process included)."""

    def __init__(self, model: torch.nn.Module, world: World):
        self.rank, self.size = world.rank, world.size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss = model.loss

    def gradient(self, batch: Batch, config: TrainConfig, micro_step: MicroStep) -> float:
        """Leave the global batch's gradient in every parameter's .grad; return the batch's loss."""
        rows, count = config.micro_batch, len(batch.starts) // config.micro_batch
        share, per_rank = rows / len(batch.starts), count // self.size
        tree, losses = TreeSum(), []
        for index in range(self.rank * per_rank, (self.rank + 1) * per_rank):
            for param in self.params:
                param.grad = None
            rows_of = slice(index * rows, (index + 1) * rows)
            losses.append(micro_step(batch.inputs[rows_of], batch.targets[rows_of], share, index))
            tree.add(self._flat_gradient())
        self._set_gradient(self._across_ranks(tree.result(), per_rank))
        loss = 0.0
        for micro_loss in self._all_losses(losses):  # in micro-batch order, as one process adds them
            loss += micro_loss * share
        return loss

    def _flat_gradient(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def _set_gradient(self, flat: torch.Tensor) -> None:
        offset = 0
        for param in self.params:
            param.grad = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()

    def _across_ranks(self, block_sum: torch.Tensor, per_rank: int) -> torch.Tensor:
        """The tree over every rank's block sum (each a whole subtree of `per_rank` leaves)."""
        if self.size == 1:
            return block_sum
        sums = [torch.empty_like(block_sum) for _ in range(self.size)]
        dist.all_gather(sums, block_sum)
        tree = TreeSum()
        for value in sums:
            tree.add(value, leaves=per_rank)
        return tree.result()

    def _all_losses(self, losses: list[float]) -> list[float]:
        if self.size == 1:
            return losses
        mine = torch.tensor(losses, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine)
        return torch.cat(gathered).tolist()
