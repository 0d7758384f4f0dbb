"""Which checkpoint a load takes: walking a store's checkpoints from the newest down, across its tiers.

The newest checkpoint whose bytes verify, that this release reads, and, in a local tier (which another
run may have used), that is this run's by its identity. Each one passed over is named; a folder whose
every checkpoint of this run is passed over is refused rather than taken for an empty one, so a run
never starts fresh over checkpoints it could not read. Under many processes with a local tier, the
ranks agree on the step or all take the durable tier's newest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exactresume.errors import CheckpointError
from exactresume.store.identity import refuse_another_run
from exactresume.store.layout import Layout, check_checkpoint
from exactresume.store.locations import Checkpoint
from exactresume.store.place import Place
from exactresume.store.refusals import Skipped, damaged_saves, none_loadable
from exactresume.store.save_gate import SaveGate
from exactresume.store.seal_hash import SealError
from exactresume.world import World

Found = tuple[Checkpoint, dict] | None


def listed(places: list[Place], layout: Layout) -> list[Checkpoint]:
    """The checkpoints of `places` (the landing tier first), oldest step first; a step in two tiers is
    listed durable first, so a walk from the newest tries the local one first."""
    tiers = enumerate(reversed(places))
    found = [(c.step, tier, c) for tier, place in tiers for c in place.checkpoints(layout)]
    return [checkpoint for _, _, checkpoint in sorted(found, key=lambda entry: entry[:2])]


def place_of(places: list[Place], checkpoint: Checkpoint) -> Place:
    return next(place for place in places if checkpoint.path.parent == place.folder)


@dataclass
class NewestSearch:
    """One walk down a store's checkpoints (`places`: the landing tier first, the durable one last).
    What it passes over is said at once, or, inside `newest_loadable`, held until an older checkpoint
    is found (a refusal names them instead); each is kept from retention (`gate`)."""

    places: list[Place]
    layout: Layout
    identity: dict | None
    gate: SaveGate
    world: World
    notify: Callable[[str], None]
    held: list[Skipped] | None = None

    def newest_loadable(self) -> Found:
        """`newest`, but a folder whose every checkpoint of this run it passes over is refused
        (CheckpointError naming them): None only when there is none."""
        self.held = []
        try:
            found = self.newest()
        finally:
            held, self.held = self.held, None
        ours = [skipped for skipped in held if not skipped.foreign]
        if found is None and ours:
            self.gate.refuse(ours[0].checkpoint, damaged_saves(self.places[0].folder))
            raise none_loadable(" and ".join(str(place.folder) for place in self.places), ours)
        if self.world.is_main or len(self.places) > 1:  # every rank reads one folder alike: rank 0 says it
            for skipped in held:
                self.notify(skipped.line())
        return self._agreed(found)

    def newest(self, places: list[Place] | None = None) -> Found:
        """The newest checkpoint of `places` (by default every tier's) that verifies, with its state."""
        for checkpoint in reversed(listed(places or self.places, self.layout)):
            place = place_of(self.places, checkpoint)
            try:
                state = place.read(checkpoint, self.layout)
            except CheckpointError as error:  # its bytes do not verify (or not with the key in force: maybe sound)
                self._skipped(checkpoint, error, damaged=not isinstance(error, SealError))
                continue
            if place is not self.places[-1] and not self._holds_this_run(checkpoint, state):
                continue  # a local tier, which another run may have used: its checkpoint is not this run's
            try:
                return checkpoint, check_checkpoint(checkpoint, state)
            except CheckpointError as error:  # sound bytes, but not a checkpoint this release reads
                self._skipped(checkpoint, error, damaged=False)
        return None

    def _holds_this_run(self, checkpoint: Checkpoint, state: dict) -> bool:
        """Whether a local tier's checkpoint is this store's run by its identity; one that is not is passed
        over, named, and a load finding no other starts fresh rather than refuse (it is not this run's work)."""
        try:
            refuse_another_run(state, self.identity, checkpoint.path)
        except CheckpointError:
            why = CheckpointError(f"{checkpoint.path}: another run's, by its identity (a local tier it also used)")
            self._skipped(checkpoint, why, damaged=False, foreign=True)
            return False
        return True

    def _agreed(self, found: Found) -> Found:
        """Under many processes with a local tier (one a node): the checkpoint of the step every rank found,
        else, for every rank, the durable tier's newest."""
        if len(self.places) == 1 or self.world.size == 1:
            return found
        steps = self.world.gather(None if found is None else found[0].step)
        if len(set(steps)) == 1:
            return found
        if self.world.is_main:
            self.notify(
                f"the ranks' local tiers hold different steps ({steps}): resuming from {self.places[-1].folder}"
            )
        durable = self.newest(self.places[-1:])
        chosen = durable[0].step if durable is not None else -1
        for checkpoint in self.places[0].checkpoints(self.layout):  # this run's own: its saves write over them
            if checkpoint.step > chosen:
                self.gate.supersede(checkpoint.path)
        return durable

    def _skipped(self, checkpoint: Checkpoint, error: CheckpointError, damaged: bool, foreign: bool = False) -> None:
        """Say that `checkpoint` was passed over on the way to an older one, and why; keep it from retention."""
        self.gate.pass_over(checkpoint.path)
        skipped = Skipped(checkpoint, error, damaged, foreign)
        if self.held is not None:
            self.held.append(skipped)
        else:
            self.notify(skipped.line())
