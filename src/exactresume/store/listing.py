"""A checkpoint folder's checkpoints, each verified and described: `exactresume inspect FOLDER`.

Any CheckpointStore's folder, whatever its parts (`train --save-every`'s, or a loop of one's own):
every `step-*.pth` (or sharded `step-*.dcp`) is read as `--resume FOLDER` reads it (checksum first,
then weights_only), and reported with its step, its parts and their sizes, or with the reason it is
refused. The newest checkpoint that verifies is the one a resume from the folder continues from.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from exactresume.errors import CheckpointError
from exactresume.store.layout import UNREADABLE_SUFFIX
from exactresume.store.locations import Checkpoint, Location, S3Location
from exactresume.store.lock import LOCK_NAME, holder_alive, read_holder
from exactresume.store.numbered import CheckpointStore, store_reading
from exactresume.store.resume import RESERVED_NAMES, check_resume_state
from exactresume.store.seal_hash import SealError, sealing

# A checkpoint the key in force (or its absence) cannot verify, though its bytes may be sound (seal_hash.SealError)
SEALED_OTHERWISE = "not verified"


def _size(path: Location) -> int | None:
    """A checkpoint's bytes: a file's or object's, or those of every file or object of a sharded one."""
    if isinstance(path, S3Location):
        from exactresume.store.s3.client import ObjectStore

        objects = ObjectStore(path.config)
        size = objects.size(path)
        return sum(objects.list(path).values()) if size is None else size
    return sum(file.stat().st_size for file in path.iterdir()) if path.is_dir() else path.stat().st_size


def _checkpoint(store: CheckpointStore, checkpoint: Checkpoint, summarize) -> dict:
    step, path = checkpoint.step, checkpoint.path
    try:
        state = check_resume_state(path, store.place.read(checkpoint, store.layout))
    except CheckpointError as error:
        status = SEALED_OTHERWISE if isinstance(error, SealError) else "damaged"
        return {"step": step, "path": str(path), "status": status, "problem": str(error), "parts": {}}
    parts = {name: summarize(value) for name, value in state.items() if name not in RESERVED_NAMES}
    found = state.get("checkpoint_step")
    status = "verified" if found == step else "damaged"
    problem = None if found == step else f"{path}: holds step {found}, not the step its name says"
    return {"step": step, "path": str(path), "status": status, "problem": problem, "parts": parts}


def _listed(store: CheckpointStore, checkpoint: Checkpoint, summarize) -> dict | None:
    """The checkpoint as listed, with its size; None when it was removed while it was read (a run writing
    the folder pruned it: it is no longer there to list, nor damaged)."""
    try:
        entry = _checkpoint(store, checkpoint, summarize)
        entry["file_bytes"] = _size(checkpoint.path)
    except FileNotFoundError:
        return None
    gone = isinstance(checkpoint.path, Path) and not checkpoint.path.exists()
    return None if gone else entry


def list_checkpoints(folder: Location, summarize) -> dict:
    """The folder's checkpoints (oldest first), each verified; `summarize(value)` sizes one part."""
    store = store_reading(folder, notify=lambda message: None)
    found, set_aside = store.checkpoints(), store.set_aside()
    if not found:
        leftovers = store.leftovers()
        what = "uncommitted object(s)" if isinstance(folder, S3Location) else ".tmp leftover(s)"
        details = [f"{len(leftovers)} {what} of interrupted saves"] if leftovers else []
        details += [f"{len(set_aside)} damaged checkpoint(s) set aside as {UNREADABLE_SUFFIX}"] if set_aside else []
        detail = f": only {' and '.join(details)}" if details else ""
        raise CheckpointError(f"{folder} is a folder holding no checkpoint (step-*.pth) and no sharded one{detail}")
    checkpoints = _read_while_pruned(store, summarize)
    valid = [c["step"] for c in checkpoints if c["status"] == "verified"]
    writer = _writer(folder)
    return {
        "path": str(folder),
        "kind": "store",
        "description": _description(checkpoints, valid, set_aside, writer),
        "checksum": _checksum(checkpoints),
        "newest_valid_step": valid[-1] if valid else None,
        "writer": writer,
        "leftovers": [str(path) for path in store.leftovers()],
        "set_aside": [str(path) for path in set_aside],
        "checkpoints": checkpoints,
    }


def _read_while_pruned(store: CheckpointStore, summarize) -> list[dict]:
    """Every checkpoint of the folder read (oldest first), the newest first: a run writing the folder
    may prune a checkpoint while it is read, and save newer ones; the folder is listed again until every
    checkpoint it holds has been read, LISTINGS times at most."""
    read: dict[int, dict] = {}
    held = store.checkpoints()
    for _ in range(LISTINGS):
        for checkpoint in reversed([c for c in held if c.step not in read]):
            entry = _listed(store, checkpoint, summarize)
            if entry is not None:
                read[checkpoint.step] = entry
        held = store.checkpoints()  # what the folder holds now: read next round what is not read yet
        still = {checkpoint.step for checkpoint in held}
        read = {step: entry for step, entry in read.items() if step in still}
        if still <= set(read):
            break
    return [read[step] for step in sorted(read)]


LISTINGS = 5


def _writer(folder: Location) -> dict | None:
    """The process writing the folder now (its lock's holder, alive on this host), or None."""
    if not isinstance(folder, Path):
        return None
    holder = read_holder(folder / LOCK_NAME)
    if holder.get("host") != socket.gethostname() or not holder_alive(holder):
        return None
    return {"pid": holder["pid"], "host": holder["host"]}


def _checksum(checkpoints: list[dict]) -> str:
    """verified: every checkpoint; mismatch: one is damaged; else not verified (by the key in force, or none)."""
    statuses = {checkpoint["status"] for checkpoint in checkpoints}
    if not statuses:
        return "none read"
    return "mismatch" if "damaged" in statuses else SEALED_OTHERWISE if SEALED_OTHERWISE in statuses else "verified"


def _description(checkpoints: list[dict], valid: list[int], set_aside: list[Path], writer: dict | None) -> str:
    if not checkpoints:  # each one listed was pruned before it could be read
        who = f"pid {writer['pid']} is writing it" if writer else "a run is writing it"
        return f"checkpoint folder whose checkpoints were all pruned while they were read ({who}): inspect it again"
    count = f"{len(checkpoints)} checkpoint" + ("s" if len(checkpoints) != 1 else "")
    damaged = sum(c["status"] == "damaged" for c in checkpoints)
    sealed = sum(c["status"] == SEALED_OTHERWISE for c in checkpoints)
    newest = f"a resume continues from step {valid[-1]}" if valid else "none verifies: a resume is refused"
    unverified = "not verified by the key set" if sealing().key is not None else "sealed with a key, none set"
    problems = [f"{damaged} damaged"] * bool(damaged) + [f"{sealed} {unverified}"] * bool(sealed)
    aside = [f"{len(set_aside)} set aside as damaged"] * bool(set_aside)
    writing = f" (being written by pid {writer['pid']})" if writer else ""
    return f"checkpoint folder{writing}: {', '.join([count, *problems, *aside])}; {newest}"


def list_tiers(durable: Location, local: Path, summarize) -> dict:
    """A two-tier run's checkpoints (store/tiers.py): each tier listed as `list_checkpoints` lists a folder,
    and the one a resume continues from: the newest that verifies, the local one first at a step both hold
    (a run's resume also passes over a local checkpoint of another identity, which a listing cannot tell)."""
    tiers = {"local": _tier(local, summarize), "durable": _tier(durable, summarize)}
    candidates = [
        (checkpoint["step"], rank, checkpoint["path"])
        for rank, tier in enumerate(("durable", "local"))
        for checkpoint in tiers[tier]["checkpoints"]
        if checkpoint["status"] == "verified"
    ]
    newest = max(candidates, default=None)
    if newest is not None:
        resume = f"a resume continues from step {newest[0]} ({newest[2]})"
    elif any(tier["checkpoints"] for tier in tiers.values()):  # as the run's resume refuses them
        resume = "none verifies: a resume is refused"
    else:
        resume = "no checkpoint: a fresh start"
    checksum = _checksum([checkpoint for tier in tiers.values() for checkpoint in tier["checkpoints"]])
    description = f"two tiers; {resume}"
    return {"path": str(durable), "kind": "tiers", "description": description, "checksum": checksum} | tiers


def _tier(folder: Location, summarize) -> dict:
    """One tier's listing; a tier that holds nothing yet (a local one wiped) is an empty one, not an error."""
    if isinstance(folder, Path) and not folder.exists():
        missing = f"{folder}: no such folder (a local tier lost with its node, or not written yet)"
        return {"path": str(folder), "description": missing, "checksum": "verified", "checkpoints": []}
    try:
        return list_checkpoints(folder, summarize)
    except CheckpointError as error:
        return {"path": str(folder), "description": str(error), "checksum": "verified", "checkpoints": []}


def format_tiers(info: dict[str, Any]) -> str:
    """The human view of `list_tiers`: the resume's checkpoint, then each tier as `format_listing` shows it."""
    lines = [f"{info['path']}: {info['description']}"]
    for tier in ("local", "durable"):
        listing = info[tier]
        shown = format_listing(listing) if listing["checkpoints"] else f"{listing['description']}"
        lines += [f"  {tier} tier: {shown.splitlines()[0]}", *("  " + line for line in shown.splitlines()[1:])]
    return "\n".join(lines)


def format_listing(info: dict[str, Any]) -> str:
    """The human view of `list_checkpoints`: one line per checkpoint, its parts and bytes."""
    lines = [f"{info['path']}: {info['description']}"]
    for checkpoint in info["checkpoints"]:
        name = Path(checkpoint["path"]).name
        if checkpoint["status"] != "verified":
            lines.append(f"  {name}  {checkpoint['status']}: {checkpoint['problem']}")
            continue
        parts = ", ".join(f"{part} {summary['bytes']:,} B" for part, summary in checkpoint["parts"].items())
        lines.append(f"  {name}  verified, {checkpoint['file_bytes']:,} bytes: {parts}")
    unfinished = (
        f"a save in progress, or left by an interrupted one (pid {info['writer']['pid']} is writing the folder)"
        if info.get("writer")
        else "leftover of an interrupted save (removed by the next writer)"
    )
    lines += [f"  {Path(path).name}  {unfinished}" for path in info["leftovers"]]
    lines += [
        f"  {Path(path).name}  set aside: damaged, renamed by a save of its step rather than written over; never read"
        for path in info.get("set_aside", [])
    ]
    return "\n".join(lines)
