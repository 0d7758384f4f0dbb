"""Causes in a streaming dataset's state, where the batch is the first fingerprint to part: a Hugging Face
`datasets` IterableDataset whose state_dict() was not saved, or was saved and restored without its shuffle
buffer's content (datasets refills the buffer on load); a plain IterableDataset that resumes its stream
but shuffles it with a torch.Generator whose state the checkpoint lacks.
"""

from __future__ import annotations

from exactresume.doctor.context import Context, later, position_evidence


def stream(c: Context):
    if "batch" not in c.diff:
        return None
    return hugging_face(c) or _stream_generator(c)


def hugging_face(c: Context):
    rows = c.live("stream")
    if not rows:
        return None
    saved = [r for r in rows if r["saved"]]
    if not saved:
        headline = (
            f"{later(c)}the data position was lost: the Hugging Face datasets IterableDataset's state_dict() is not "
            "in the checkpoint, so the resumed run streams from the dataset's start"
        )
        return "stream_position_lost", headline, position_evidence(c)
    size = saved[0].get("buffer")
    if not size:
        return None
    headline = (
        f"{later(c)}the shuffle buffer was lost: the checkpoint holds the datasets IterableDataset's state_dict(), "
        f"which keeps the stream's position but not the content of its shuffle buffer ({size} examples); "
        "load_state_dict() refills the buffer from the restored position, so the resumed run draws other examples"
    )
    evidence = [*position_evidence(c), "the dataset's state_dict() as saved is in the checkpoint"]
    return "shuffle_buffer_lost", headline, evidence


def _stream_generator(c: Context):
    """A stream shuffled by a torch.Generator the checkpoint lacks, resumed past its first batch (a stream
    started over is a lost position, data_position's)."""
    lost = c.unsaved("stream_rng")
    if not lost or c.straight_step_with("batch", c.resumed["batch"]) == 1:
        return None
    name = lost[0]["name"]
    headline = (
        f"{later(c)}the stream's shuffle generator was not saved: {name} (a torch.Generator) is not in the "
        "checkpoint, so the resumed stream shuffles its examples with a fresh generator"
    )
    return "stream_rng_lost", headline, [*position_evidence(c), f"{name}'s state (get_state()) is not in the file"]
