"""A CheckpointStore on an object store: `CheckpointStore("s3://bucket/run/checkpoints")` makes one.

    store = CheckpointStore("s3://bucket/run/checkpoints", keep=3)
    store.save(step, parts)     # s3://bucket/run/checkpoints/step-00000030.pth, then its .commit
    step = store.load(parts)    # the newest committed checkpoint whose objects verify

The same interface and guarantees as a folder (folder.py), with the commit object (s3/commit.py) in
place of the rename. A save is one sequence of stages, each a fault-injection point (faults.py):

    snapshot -> write (torch.save into the upload) -> upload (each part as it fills; verified) -> commit -> retention

Keep-K deletes older checkpoints (their commit first) only after the new commit is verified. The
newest checkpoint is found by one listing of the prefix (all its pages), not a request per step;
a checkpoint without its commit object is not listed. At the start of a run (`remove_leftovers`)
the multipart uploads a killed save abandoned are aborted and its uncommitted objects deleted.
One run writes a prefix: a writer takes its lease (s3/lease.py) before it cleans or commits, and
checks it before each commit and before keep-K deletes, so a second run is refused naming the holder
and a run whose lease was taken stops before it overwrites or deletes anything.
"""

from __future__ import annotations

from collections.abc import Callable

from exactresume.config import check_keep
from exactresume.errors import CheckpointError, notice
from exactresume.store.faults import FaultPoints
from exactresume.store.locations import Checkpoint, S3Config, S3Location, location
from exactresume.store.lock import FolderLock
from exactresume.store.numbered import CHECKPOINT_NAME, NumberedStore, check_checkpoint
from exactresume.store.s3.client import ObjectStore
from exactresume.store.s3.commit import COMMIT_SUFFIX, commit_of
from exactresume.store.s3.files import load_committed, publish_sealed
from exactresume.store.s3.lease import S3Lease
from exactresume.world import World


class S3CheckpointStore(NumberedStore):
    """Numbered checkpoints under one prefix of a bucket, committed by commit objects."""

    def __init__(
        self,
        folder: S3Location | str,
        keep: int | None = 3,
        notify: Callable[[str], None] = notice,
        lock: FolderLock | None = None,
        config: S3Config | None = None,
        wait_lock: float = 0.0,
        background: bool = False,
        copy: str | None = None,
        world: World | None = None,
        sharded: bool = False,  # CheckpointStore's signature: a sharded store on a prefix is refused before
        identity: dict | None = None,
    ):
        self.folder, self.keep, self.notify = location(folder, config), check_keep(keep), notify
        self.faults = FaultPoints.from_environment()
        self.objects = ObjectStore(self.folder.config)
        self.objects.before_part = lambda number: self.faults.reached("upload")
        self.wait_lock, self.lease = wait_lock, None
        self._set_saving(background, copy, world, identity)

    def hold_lock(self) -> None:
        """Take the prefix's lease for this store's writes (waiting up to `wait_lock` s), else UserError."""
        if self.lease is None:
            with self._one_writer():
                self.lease = S3Lease.acquire(self.objects, self.folder, self.wait_lock, self.notify)

    def release(self) -> None:
        """Release the lease: another run may write the prefix."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def path_for(self, step: int) -> S3Location:
        return self.folder / f"step-{step:08d}.pth"

    def _listing(self) -> tuple[list[Checkpoint], list[str], dict[str, int]]:
        """One paginated listing: the committed checkpoints (oldest first) and the uncommitted objects.

        The commit decides: a commit whose object is gone is listed (and refused when read, saying so)."""
        names = self.objects.list(self.folder)
        committed, uncommitted = [], []
        for name in names:
            found = CHECKPOINT_NAME.match(name.removesuffix(COMMIT_SUFFIX))
            if found is None:
                continue
            if name.endswith(COMMIT_SUFFIX):
                committed.append(Checkpoint(int(found.group(1)), self.folder / found.group(0)))
            elif name + COMMIT_SUFFIX not in names:
                uncommitted.append(name)
        return sorted(committed, key=lambda c: c.step), sorted(uncommitted), names

    def checkpoints(self) -> list[Checkpoint]:
        """The committed checkpoints, oldest step first (one listing; nothing is read)."""
        return self._listing()[0]

    def leftovers(self) -> list[S3Location]:
        """Objects of saves that did not commit (a checkpoint without its commit)."""
        return [self.folder / name for name in self._listing()[1]]

    def remove_leftovers(self) -> list[S3Location]:
        """Abort the uploads a killed save abandoned and delete its uncommitted objects: what was deleted."""
        self.hold_lock()
        aborted = self.objects.abort_uploads(self.folder)
        removed = self.leftovers()
        self.objects.delete(removed)
        if aborted:
            self.notify(f"aborted {aborted} unfinished upload(s) under {self.folder}")
        return removed

    def commit(self, step: int, state: dict, before_publish: Callable[[], None] | None = None) -> S3Location:
        """The stages after the snapshot: write, upload (verified), commit, retention; `before_publish()`
        runs before the object is completed (folder.py says why)."""
        target = self.path_for(step)
        self.hold_lock()
        lease = self.lease
        lease.check()  # before the object is written over: another run may have committed this step

        def publish() -> None:
            lease.check()
            if before_publish is not None:
                before_publish()

        publish_sealed(self.objects, target, state, self.faults.reached, publish)
        lease.check()
        self._retain(step)
        return target

    def verifies(self, checkpoint: Checkpoint) -> bool:
        """Whether the committed checkpoint's object reads back as its commit says."""
        try:
            load_committed(self.objects, checkpoint.path)
        except CheckpointError:
            return False
        return True

    def _delete(self, older: list[Checkpoint]) -> None:
        """Each commit first: a checkpoint whose object is gone is never left committed."""
        self.objects.delete([commit_of(c.path) for c in older])
        self.objects.delete([c.path for c in older])

    def load_newest(self) -> tuple[Checkpoint, dict] | None:
        """The newest committed checkpoint whose objects verify, with its state; each one passed over is
        named to `notify`."""
        committed, _, sizes = self._listing()
        for checkpoint in reversed(committed):
            try:
                state = load_committed(self.objects, checkpoint.path, sizes.get(checkpoint.path.name, 0))
            except CheckpointError as error:  # its objects do not verify, or are gone
                self.skipped(checkpoint, error, damaged=True)
                continue
            try:
                return checkpoint, check_checkpoint(checkpoint, state)
            except CheckpointError as error:
                self.skipped(checkpoint, error, damaged=False)
        return None
