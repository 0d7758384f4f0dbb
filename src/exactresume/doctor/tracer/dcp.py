"""What a torch.distributed.checkpoint (DCP) folder holds, read from its `.metadata`.

A DCP save is often given Stateful wrappers (torchtitan's ModelWrapper, OptimizersContainer) rather
than tensors: what they hold is only known once DCP has called their state_dict() and written it. The
folder's metadata names every saved entry by its flattened path ("model.0.weight",
"optimizer.state.0.weight.exp_avg", "lr_scheduler.last_epoch"), which tells which live objects the
folder holds without reading its data. Imported only once the script has imported DCP.
"""

from __future__ import annotations

LIMIT = 400  # tensors listed per file, as fingerprint.summary lists them


def parts(folder: str) -> dict:
    """The folder's entries (`keys`) and its tensors' paths, dtypes and sizes (`tensors`)."""
    from torch.distributed.checkpoint import FileSystemReader

    found = FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = [
        {"key": key, "dtype": str(entry.properties.dtype), "shape": list(entry.size)}
        for key, entry in found.items()
        if hasattr(entry, "size") and hasattr(entry, "properties")
    ]
    return {"keys": list(found), "tensors": tensors[:LIMIT]}


def covered(rows: list[dict], keys: list[str], live) -> list[dict]:
    """The coverage rows (live.coverage), each live model, optimizer or LR scheduler counted as saved
    when the folder's entries name its state."""
    held = {(kind, type(obj).__name__) for kind, obj in named(keys, live)}
    return [row | {"saved": True, "detail": ""} if (row["kind"], row["name"]) in held else row for row in rows]


def named(keys: list[str], live):
    """The live objects whose state the entries `keys` name, with their kind."""
    suffixes = {".".join(key.split(".")[i:]) for key in keys for i in range(key.count(".") + 1)}
    components = [key.split(".") for key in keys]
    lasts = {parts[-1] for parts in components}
    optimizer = any("state" in parts for parts in components) and any("param_groups" in p for p in components)
    for model in list(live.models):
        if set(model.state_dict()) <= suffixes:
            yield "model", model
    for opt in list(live.optimizers):
        if optimizer and {name for state in opt.state.values() for name in state} <= lasts:
            yield "optimizer", opt
    for sched in list(live.schedulers):
        if "last_epoch" in lasts:
            yield "lr_scheduler", sched
