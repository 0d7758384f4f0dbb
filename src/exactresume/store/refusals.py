"""What a store says when it passes a checkpoint over or refuses to load or save: one line each.

A checkpoint passed over on the way to an older one (`Skipped`) is named with why; a store that found
checkpoints it could not load says so rather than start fresh over them, and then saves nothing that
could write over or delete them (save_gate.py holds the bar, these are its lines).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactresume.errors import CheckpointError
from exactresume.store.locations import Checkpoint, Location
from exactresume.store.seal_hash import SealError, sealing

NAMED = 3  # checkpoints a refusal names before "and N more"


@dataclass(frozen=True)
class Skipped:
    """A checkpoint a load passed over, and why: its bytes do not verify (`damaged`), it is not one this
    release reads, or it is another run's in a local tier (`foreign`)."""

    checkpoint: Checkpoint
    error: CheckpointError
    damaged: bool
    foreign: bool = False

    def line(self) -> str:
        return f"skipping {'damaged ' if self.damaged else ''}checkpoint {self.error}"


ANOTHER_RUN_WAY_OUT = (
    "call store.load(parts, any_identity=True) (later saves record the store's identity), or use another folder"
)


def another_run_saves(checkpoint: Checkpoint) -> str:
    return (
        f"{checkpoint.path} is not known to be this store's run (its identity), so this store saves nothing that "
        "could write over or delete it: load it with store.load(parts, any_identity=True), or use another folder"
    )


def misfit_saves(checkpoint: Checkpoint) -> str:
    return (
        f"{checkpoint.path} could not be loaded into the parts given, so this store saves nothing "
        "that could write over or delete it: load it as the load's error says (skip=, fresh=, or the "
        "parts it was saved from), or move it out of the folder"
    )


def damaged_saves(folder: Location) -> str:
    return (
        f"no checkpoint of {folder} could be loaded, so this store saves nothing beside them: move them out "
        "of the folder to start fresh, or use another folder"
    )


def none_loadable(folder: Location | str, passed: list[Skipped]) -> CheckpointError:
    """The one line for a folder (or a store's two tiers) none of whose checkpoints loads (`passed`, newest
    first): a run started fresh there would train, and save, over them."""
    tiers = len({skipped.checkpoint.path.parent for skipped in passed}) > 1  # the same name in both: say whose
    names = [_name(skipped.checkpoint.path, tiers) for skipped in passed]
    newest = passed[0]
    reason = str(newest.error).removeprefix(f"{newest.checkpoint.path}: ")  # the line names the folder once
    if len(names) == 1:
        what = f"the only checkpoint in {folder} cannot be loaded ({names[0]}: {reason})"
    else:
        more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
        listed = ", ".join(names[:NAMED]) + more
        what = f"none of the {len(names)} checkpoints in {folder} can be loaded ({listed}; the newest: {reason})"
    them = "it" if len(names) == 1 else "them"
    if all(isinstance(skipped.error, SealError) for skipped in passed):  # sound bytes, maybe: the key differs
        written = "it was" if len(names) == 1 else "they were"
        unkeyed = " (unset it where sealed without a key)" if sealing().key is not None else ""
        return CheckpointError(f"{what}; nothing was loaded: set the key {written} written with{unkeyed}")
    return CheckpointError(
        f"{what}; nothing was loaded, rather than start fresh over {them}: to start "
        "fresh on purpose, move the checkpoints out of the folder (or delete them), or use another folder"
    )


def sealed_otherwise_saves(path: Location, reason: str) -> str:
    """The line every save says beside a checkpoint sealed otherwise than the store seals (another key, or
    none): it may be sound, and a save here would continue beside it, or prune it."""
    reason = reason.removeprefix(f"{path}: ")
    return (
        f"{path.parent} holds {path.name}, which this store cannot verify ({reason}); nothing was saved: "
        "resume it with the key it was written with (none where sealed without one), or save into another folder"
    )


def other_layout(ahead: Checkpoint, sharded_store: bool) -> str:
    """The line for a checkpoint of the other layout ahead of this store's: a store of one layout never
    reads the other's, so a load would find nothing newer, and a save would go on beside it."""
    kind, way = ("one-file", "sharded=False (the default)") if sharded_store else ("sharded", "sharded=True")
    mine = "sharded" if sharded_store else "one-file"
    return (
        f"{ahead.path.parent} holds {ahead.path.name}, a {kind} checkpoint later than any {mine} one of this "
        f"store, which reads only its own kind: open the folder as the run that saved it did "
        f"(CheckpointStore(..., {way}); exactresume train: the same --shard), or move that run's checkpoints out"
    )


def _name(path: Location, with_folder: bool) -> str:
    return f"{path.parent.name}/{path.name}" if with_folder else path.name
