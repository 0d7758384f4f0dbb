"""Where a store keeps its checkpoints, as the store sees it: a folder on a disk (disk.py) or a prefix of
a bucket (s3/prefix.py). Each lists, locks, writes, reads, verifies and prunes checkpoints of either
layout (layout.py) its own way; the store (numbered.py) decides when.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from exactresume.store.faults import FaultPoints
from exactresume.store.layout import Layout
from exactresume.store.locations import Checkpoint, Location
from exactresume.world import World

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


@dataclass(frozen=True)
class Publishing:
    """What a save's caller is told around the moment its file is published (background.py): `before()`
    just before (if it raises, nothing is published), `after()` once it is durable at its name, before it
    is read back and the older ones pruned."""

    before: Callable[[], None] | None = None
    after: Callable[[], None] | None = None

    def ready(self) -> None:
        if self.before is not None:
            self.before()

    def done(self) -> None:
        if self.after is not None:
            self.after()


class Place(Protocol):
    """Where a store's checkpoints live: a folder on a disk (disk.py) or a prefix of a bucket (s3/prefix.py)."""

    folder: Location
    notify: Callable[[str], None]

    def hold_lock(self) -> None: ...
    def release(self) -> None: ...
    def gave_up(self) -> bool: ...
    def checkpoints(self, layout: Layout) -> list[Checkpoint]: ...
    def leftovers(self, layout: Layout) -> list[Location]: ...
    def set_aside(self) -> list[Location]: ...
    def remove_leftovers(self, layout: Layout) -> list[Location]: ...
    def unwritable(self, error: OSError) -> str | None: ...
    def prepare(self, checkpoint: Checkpoint, layout: Layout, not_ours: bool = False) -> None: ...
    def write_file(self, checkpoint: Checkpoint, state: dict, faults: FaultPoints, publishing: Publishing) -> None: ...
    def write_copy(self, checkpoint: Checkpoint, source: BinaryIO) -> None: ...
    def write_sharded(
        self,
        checkpoint: Checkpoint,
        parts: Mapping[str, Stateful],
        world: World,
        identity: dict | None,
        faults: FaultPoints,
    ) -> None: ...
    def read(self, checkpoint: Checkpoint, layout: Layout) -> Any: ...
    def verifies(self, checkpoint: Checkpoint, layout: Layout) -> bool: ...
    def delete(self, older: list[Checkpoint], layout: Layout) -> None: ...
