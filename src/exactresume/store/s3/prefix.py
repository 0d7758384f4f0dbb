"""Where a store keeps its checkpoints on an object store: a prefix, written by one run under its lease.

    CheckpointStore("s3://bucket/run/checkpoints", keep=3)                 # step-00000030.pth, then its .commit
    CheckpointStore("s3://bucket/run/checkpoints", sharded=True, world=w)  # step-00000030.dcp/…, commit.pth last

The same guarantees as a folder on a disk (disk.py), with a commit object (s3/commit.py) in place of
the rename. A one-file save is staged as

    write (torch.save into the upload) -> upload (each part as it fills; verified) -> commit

and a sharded one has every rank upload its shard, rank 0 committing once all have (s3/sharded.py).
A checkpoint without its commit object is not listed; the newest is found by one listing of the
prefix (all its pages), not a request per step. At the start of a run (`remove_leftovers`) the
multipart uploads a killed save abandoned are aborted and its uncommitted objects deleted. One run
writes a prefix: a writer takes its lease (s3/lease.py) before it cleans or commits, and checks it
before each commit and before keep-K deletes, so a second run is refused naming the holder and a run
whose lease was taken stops before it overwrites or deletes anything. Retention deletes each commit
before its objects: a checkpoint whose objects are gone is never left committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from exactresume.errors import CheckpointError
from exactresume.store.faults import FaultPoints
from exactresume.store.layout import COMMIT, PASSED_OVER, UNREADABLE_SUFFIX, Layout, is_set_aside, set_aside_line
from exactresume.store.locations import Checkpoint, S3Location
from exactresume.store.place import Publishing
from exactresume.store.s3.client import ObjectStore
from exactresume.store.s3.commit import COMMIT_SUFFIX
from exactresume.store.s3.files import load_committed, publish_file, publish_sealed
from exactresume.store.s3.lease import S3Lease
from exactresume.store.seal_hash import SealError
from exactresume.world import World

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


class S3Prefix:
    """A prefix of checkpoints on an object store: listed, written under its lease, read, pruned."""

    def __init__(self, folder: S3Location, notify: Callable[[str], None], faults: FaultPoints, wait_lock: float = 0.0):
        self.folder, self.notify, self.wait_lock = folder, notify, wait_lock
        self.objects = ObjectStore(folder.config)
        self.objects.before_part = lambda number: faults.reached("upload")
        self.lease: S3Lease | None = None
        self.sizes: dict[str, int] = {}  # the objects' sizes at the last listing

    def hold_lock(self) -> None:
        """Take the prefix's lease for this store's writes (waiting up to `wait_lock` s), else UserError."""
        if self.lease is None:
            self.lease = S3Lease.acquire(self.objects, self.folder, self.wait_lock, self.notify)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def gave_up(self) -> bool:
        """Whether the store stopped answering (a request out of tries, none answered since): a close does not
        wait on it again."""
        return self.objects.gave_up()

    def _listing(self, layout: Layout) -> tuple[list[Checkpoint], list[str]]:
        """One paginated listing: the committed checkpoints (oldest first) and the objects of uncommitted ones.

        The commit decides: a commit whose objects are gone is listed (and refused when read, saying so)."""
        names = self.sizes = self.objects.list(self.folder)
        committed, uncommitted = [], []
        for name in names:
            checkpoint, _, inside = (
                name.partition("/") if layout.sharded else (name.removesuffix(COMMIT_SUFFIX), "", "")
            )
            step = layout.step_of(checkpoint)
            if step is None:
                continue
            if name == _commit_name(checkpoint, layout):
                committed.append(Checkpoint(step, self.folder / checkpoint))
            elif _commit_name(checkpoint, layout) not in names:
                uncommitted.append(name)
        return sorted(committed, key=lambda c: c.step), sorted(uncommitted)

    def checkpoints(self, layout: Layout) -> list[Checkpoint]:
        """The committed checkpoints, oldest step first (one listing; nothing is read)."""
        return self._listing(layout)[0]

    def leftovers(self, layout: Layout) -> list[S3Location]:
        """Objects of saves that did not commit."""
        return [self.folder / name for name in self._listing(layout)[1]]

    def set_aside(self) -> list[S3Location]:
        """Checkpoints a save copied to `NAME.unreadable` before committing their step anew: kept, never read."""
        tops = {name.partition("/")[0] for name in self.objects.list(self.folder)}
        return [self.folder / name for name in sorted(tops) if is_set_aside(name)]

    def remove_leftovers(self, layout: Layout) -> list[S3Location]:
        """Abort the uploads a killed save abandoned and delete its uncommitted objects: what was deleted."""
        self.hold_lock()
        aborted = self.objects.abort_uploads(self.folder)
        removed = self.leftovers(layout)
        self.objects.delete(removed)
        if aborted:
            self.notify(f"aborted {aborted} unfinished upload(s) under {self.folder}")
        return removed

    def unwritable(self, error: OSError) -> str | None:
        return None  # the object store's refusal says itself why (s3/client.py)

    # -- writing ----------------------------------------------------------------------------------

    def prepare(self, checkpoint: Checkpoint, layout: Layout, not_ours: bool = False) -> None:
        """Before a checkpoint is written: the prefix's lease held, and still this run's; one at its name that
        the load before passed over (`not_ours`) copied to `NAME.unreadable` first: its bytes may matter to
        someone, and its step is about to be committed anew."""
        self.hold_lock()
        self.lease.check()  # before anything is written over: another run may have committed this step
        if not_ours:
            self._set_aside(checkpoint)

    def _set_aside(self, checkpoint: Checkpoint) -> None:
        names = self.objects.list(self.folder)
        name = checkpoint.path.name
        kept = (name, name + COMMIT_SUFFIX)  # a one-file checkpoint's commit beside it; a sharded one's inside
        objects = {below: size for below, size in names.items() if below in kept or below.startswith(name + "/")}
        if not objects:
            return
        aside, number = name + UNREADABLE_SUFFIX, 1
        while any(below == aside or below.startswith(aside + "/") for below in names):
            number += 1
            aside = f"{name}{UNREADABLE_SUFFIX}.{number}"
        for below, size in objects.items():
            self.objects.copy(self.folder / below, self.folder / (aside + below[len(name) :]), size)
        self.notify(set_aside_line(checkpoint.path, aside, PASSED_OVER))

    def write_file(self, checkpoint: Checkpoint, state: dict, faults: FaultPoints, publishing: Publishing) -> None:
        """The one-file checkpoint uploaded, verified and committed; `publishing` is told before the old commit
        is deleted and the object completed, and once the new commit is written (background.py says why);
        once `prepare`d."""
        lease = self.lease

        def publish() -> None:
            lease.check()
            publishing.ready()

        publish_sealed(self.objects, checkpoint.path, state, faults.reached, publish)
        publishing.done()
        lease.check()

    def write_sharded(
        self,
        checkpoint: Checkpoint,
        parts: Mapping[str, Stateful],
        world: World,
        identity: dict | None,
        faults: FaultPoints,
    ) -> None:
        """Every rank uploads its shard; rank 0 commits once all have, under the lease (s3/sharded.py)."""
        from exactresume.store.s3.sharded import save_sharded_s3  # DCP takes a second to import: only when used

        save_sharded_s3(checkpoint.path, parts, world, checkpoint.step, identity, self.objects, faults.reached)

    def write_copy(self, checkpoint: Checkpoint, source: BinaryIO) -> None:
        """A verified checkpoint of another tier uploaded as it is, verified, then committed (once `prepare`d)."""
        publish_file(self.objects, checkpoint.path, Path(f"/proc/self/fd/{source.fileno()}"), self.lease.check)

    # -- reading and pruning ----------------------------------------------------------------------

    def read(self, checkpoint: Checkpoint, layout: Layout) -> Any:
        """The committed checkpoint's state, its objects verified first (CheckpointError: they do not)."""
        if layout.sharded:
            from exactresume.store.s3.sharded import load_sharded_s3

            return load_sharded_s3(checkpoint.path)
        return load_committed(self.objects, checkpoint.path, self.sizes.get(checkpoint.path.name, 0))

    def verifies(self, checkpoint: Checkpoint, layout: Layout) -> bool:
        """Whether the committed checkpoint reads back as its commit says; SealError for one sealed otherwise
        than the sealing in force (seal_hash.py), whose bytes may be sound."""
        try:
            self.read(checkpoint, layout)
        except SealError:
            raise
        except CheckpointError:
            return False
        return True

    def delete(self, older: list[Checkpoint], layout: Layout) -> None:
        """Each commit first: a checkpoint whose objects are gone is never left committed."""
        self.objects.delete([self.folder / _commit_name(c.path.name, layout) for c in older])
        if not layout.sharded:
            self.objects.delete([c.path for c in older])
            return
        for checkpoint in older:
            self.objects.delete([checkpoint.path / name for name in self.objects.list(checkpoint.path)])


def _commit_name(checkpoint: str, layout: Layout) -> str:
    """The name of a checkpoint's commit object below the prefix."""
    return f"{checkpoint}/{COMMIT}" if layout.sharded else checkpoint + COMMIT_SUFFIX
