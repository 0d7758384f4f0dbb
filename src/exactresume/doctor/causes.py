"""From the first differing fingerprints to a cause in the user's words, with its evidence.

Each rule reads the straight and resumed records of the first step where they part, the files
the interrupted run saved at the resume step (what they hold, which live objects they lack) and
the files the resumed run loaded. The first rule that applies names the cause.
"""

from __future__ import annotations

from pathlib import Path

from exactresume.doctor.context import Context, later, position_evidence
from exactresume.doctor.forward import buffers_only, forward_state, optimizer_order
from exactresume.doctor.random_sources import describe, parted
from exactresume.doctor.streaming import stream
from exactresume.errors import listed

HALF = ("torch.float16", "torch.bfloat16")


def cause_of(c: Context) -> tuple[str, str, list[str]]:
    rules = (accumulation_window, optimizer_order, weights, weights_only, resumed_at_saved_step, batch_randomness)
    rules += (generator_behind, augmentation, rng_batches, stream, data_position, schedule, rng, forward_state)
    rules += (buffers_only,)
    for rule in (*rules, optimizer, scaler):
        found = rule(c)
        if found:
            return found
    return "state_differs", f"the {', '.join(c.diff)} differ from step {c.step} on", []


def also(c: Context, first: str) -> tuple[str, str, list[str]] | None:
    """A second cause that parts at the same step: the forward's randomness, once the data is named."""
    data = ("data_position_lost", "epoch_lost", "weights_only", "stream_position_lost", "shuffle_buffer_lost")
    if first not in (*data, "stream_rng_lost") or not c.draws():
        return None
    return rng(c, data_too=True)


def accumulation_window(c: Context):
    inside = [f for f in c.runs.files if f["pending_micro"]]
    if not inside or not {"batch", "grads"} & set(c.diff):
        return None
    name, pending = Path(inside[0]["path"]).name, inside[0]["pending_micro"]
    micro, resumed = len(c.straight.get("micro", [])), len(c.resumed.get("micro", []))
    headline = (
        f"the checkpoint was written inside a gradient-accumulation window: {name} was saved after {pending} of "
        f"step {c.runs.resume_step + 1}'s {micro} micro-batches, whose gradients it does not hold"
    )
    return "accumulation_window", headline, [f"micro-batches in step {c.step}: {resumed} resumed, {micro} straight"]


def weights(c: Context):
    if "params" not in c.diff or c.index:
        return None
    loaded = c.loaded()
    halves = [(f, [t for t in f["tensors"] if t["dtype"] in HALF]) for f in loaded]
    halves = [(f, ts) for f, ts in halves if ts]
    if halves:
        f, ts = halves[0]
        shapes = {tuple(t["shape"]) for t in ts}
        full = [
            g
            for g in c.runs.files
            if g is not f and any(t["dtype"] not in HALF and tuple(t["shape"]) in shapes for t in g["tensors"])
        ]
        name, dtype = Path(f["path"]).name, ts[0]["dtype"].removeprefix("torch.")
        evidence = [f"{name}: {len(ts)} tensors in {dtype}, e.g. {ts[0]['key']}"]
        if full:
            other = Path(full[0]["path"]).name
            headline = f"the weights were loaded from the {dtype} weights file {name} rather than from {other}"
            return "weights_file", headline + ", which holds them in full precision", evidence
        return "weights_rounded", f"the weights were not restored exactly: stored in {dtype} in {name}", evidence
    if c.resumed["params"] == c.runs.straight.steps[0]["params"]:
        return (
            "weights_not_loaded",
            "the weights were not loaded: the resumed run starts from the fresh initialization",
            [],
        )
    return (
        "weights_differ",
        f"the weights at the resume differ from the straight run's at step {c.runs.resume_step}",
        [],
    )


def weights_only(c: Context):
    loaded = c.loaded()
    if not loaded or not all(_flat_state(f) for f in loaded) or not c.unsaved("optimizer"):
        return None
    names = ", ".join(Path(f["path"]).name for f in loaded)
    lost = [NAMES_LOST[f] for f in ("batch", "lr", "optim") if f in c.diff]
    lost[-1:] = [f"{lost[-1]} were" if len(lost) > 1 else f"{lost[-1]} was"] if lost else []
    return (
        "weights_only",
        f"the checkpoint holds only the model's weights ({names}): {listed(lost) or 'the training state was'} lost",
        position_evidence(c),
    )


NAMES_LOST = {"batch": "the data position", "lr": "the lr schedule", "optim": "the optimizer state"}


def _flat_state(f: dict) -> bool:
    """A bare model.state_dict(): every top-level key is a tensor."""
    return bool(f["keys"]) and {t["key"] for t in f["tensors"]} == set(f["keys"])


def same_samples(c: Context) -> bool:
    """The resumed step read the straight run's samples (the DataLoader's index lists), where the tracer saw them."""
    return c.straight.get("indices") is not None and c.straight.get("indices") == c.resumed.get("indices")


def resumed_at_saved_step(c: Context):
    """The first resumed step trains again the batch of the step the checkpoint was saved after."""
    k = c.runs.resume_step
    if c.index or "batch" not in c.diff or k < 1 or c.runs.straight.steps[k - 1].get("batch") != c.resumed["batch"]:
        return None
    headline = (
        f"the resumed run trains step {k}'s batch again: it starts at the saved step, not the one after (the "
        f"checkpoint was saved after step {k}, and the resumed loop began at step {k} again)"
    )
    evidence = [f"the resumed step {k + 1} drew the batch of step {k}, the last step the checkpoint holds"]
    return "resumed_at_saved_step", headline, evidence


def augmentation(c: Context):
    """The same samples, another batch: the randomness that transformed them parted, not the data position."""
    if "batch" not in c.diff or not same_samples(c):
        return None
    # torch's RNG, where the script set it back: moved since by the resume's own DataLoader iterator, not a loss
    restored = ("rng_torch",) if c.resumed_events("rng_set") else ()
    sources = [f for f in parted(c.diff) if f not in restored]
    evidence = [f"the resumed step {c.step} read the samples of the straight run's step {c.step}"]
    if not sources:  # no RNG of the main process parted: the workers' own, or one the script does not hold
        headline = (
            f"{later(c)}the resumed step read the straight run's samples, but their random augmentation differs, "
            "drawn where the doctor cannot see it: in the DataLoader's workers (their RNGs start again from their "
            "seeds at a resume), or from a source no variable of the script holds"
        )
        return "augmentation_unseen", headline, evidence
    headline = (
        f"{later(c)}the resumed step read the straight run's samples, but their random augmentation differs: "
        f"it is drawn from {describe(sources[0])}, whose state the resume did not restore"
    )
    return "augmentation_rng_lost", headline, evidence


def _order_source(c: Context) -> str | None:
    """The source the order was drawn from, where the DataLoader's own generators did not part: one the
    script holds, or numpy's or Python's global RNG."""
    if "data" in c.diff:
        return None
    sources = [f for f in parted(c.diff) if f not in ("rng_torch", "rng_cuda")]
    return sources[0] if sources else None


def data_position(c: Context):
    if "batch" not in c.diff or same_samples(c):
        return None
    evidence = position_evidence(c)
    epochs_a, epochs_b = c.straight.get("sampler_epochs"), c.resumed.get("sampler_epochs")
    if epochs_a != epochs_b and any(e is not None for e in epochs_a or []):
        return (
            "epoch_lost",
            f"{later(c)}the sampler's epoch was not restored: set_epoch({epochs_b[0]}) in the resumed run, "
            f"set_epoch({epochs_a[0]}) in the straight run, so it replays another epoch's order",
            evidence,
        )
    sources = sorted({s for f in c.runs.files for s in f.get("loaders", [])})
    gens = c.unsaved("generator")
    source = f"; the order comes from {sources[0]}" if sources else ""
    drawn = _order_source(c)
    if drawn is not None:
        lost = f"{', ' if sources else ': the order is '}drawn from {describe(drawn)}, which the resume did not restore"
    else:
        lost = "; its generator state is not in the checkpoint" if gens else ""
    return "data_position_lost", f"{later(c)}the data position was lost{source}{lost}", evidence


def generator_behind(c: Context):
    """A StatefulDataLoader given generator=: its sampler's iterator saves the generator's state before it
    draws the epoch's order, and the DataLoader then draws its workers' base seed from the same generator.
    The resume restores that state and redraws the order but not the base seed's draw: its generator is one
    draw behind, which shows as the next epoch begins."""
    if "batch" not in c.diff or c.ahead is None:
        return None
    loaders = [
        s for f in c.runs.files for s in f.get("loaders") or [] if s.endswith("(its position is in its state_dict())")
    ]
    shared = any(e["event"] == "iter" and e.get("generator") for e in c.runs.straight.first.events)
    if not loaders or not shared:
        return None
    name = loaders[0].split(" > ")[0]
    headline = (
        f"{later(c)}the data position was lost: {name}'s state_dict() restores its generator= as its sampler "
        "began the epoch, but the DataLoader then drew its workers' base seed from the same generator, a draw the "
        "resume does not replay: the generator is one draw behind, and the next epoch draws another order"
    )
    evidence = [f"the {name}'s generator state differs from step {c.ahead}, the batches still equal"]
    return "generator_behind", headline, evidence + position_evidence(c)


def rng_batches(c: Context):
    """No DataLoader draws the batches, and the global torch RNG differs as the batch does: the script draws
    them from that RNG itself (nanoGPT's get_batch: random offsets from torch.randint)."""
    if not {"batch", "rng_torch"} <= set(c.diff) or any(f.get("loaders") for f in c.runs.files):
        return None
    if any(e["event"] == "iter" for e in c.runs.straight.first.events):
        return None
    saved = c.live("global_rng")
    state = "was not saved" if not saved or c.unsaved("global_rng") else "was restored at another moment"
    headline = (
        f"{later(c)}the batches are drawn from the global torch RNG by the script itself (no DataLoader draws "
        f"them), and its state {state}: the resumed run draws other batches"
    )
    return "rng_batches", headline, [*position_evidence(c), f"the torch RNG state differs at step {c.step}"]


def schedule(c: Context):
    if "lr" not in c.diff:
        return None
    a, b = c.straight["lr"], c.resumed["lr"]
    evidence = [f"lr {b[0]:.6g} in the resumed step {c.step}, {a[0]:.6g} in the straight one"]
    first = c.runs.straight.steps[0]["lr"]
    restarted = b == first
    if restarted:
        evidence.append("the resumed lr is step 1's: the schedule restarted from step 0")
    if c.unsaved("lr_scheduler"):
        name = c.unsaved("lr_scheduler")[0]["name"]
        return (
            "scheduler_lost",
            f"{later(c)}the LR scheduler's state was not saved ({name}): its schedule restarted",
            evidence,
        )
    if "optim" in c.diff and (c.unsaved("optimizer") or c.resumed.get("optim_step") == c.index + 1):
        # A fresh optimizer holds the lr it was built with: a restored scheduler writes over it only at its next step.
        cause, headline, more = optimizer(c)
        until = " (the restored scheduler sets it only at its next step)" if c.live("lr_scheduler") else ""
        return cause, f"{headline}; its lr is the one it was built with{until}", evidence[:1] + more
    if not c.live("lr_scheduler") and restarted:
        return (
            "lr_from_zero",
            f"{later(c)}the script computes the lr from a step count that restarts at 0 after the resume",
            evidence,
        )
    return (
        "lr_differs",
        f"{later(c)}the lr differs: the schedule did not continue from step {c.runs.resume_step}",
        evidence,
    )


def rng(c: Context, data_too: bool = False):
    """The torch RNG is what differs: not saved, or restored and then drawn from by a new DataLoader iterator."""
    if not {"rng_torch", "rng_cuda"} & set(c.diff) or (not data_too and {"batch", "params", "lr"} & set(c.diff)):
        return None
    if not data_too and "grads" not in c.diff and not c.draws():
        return None
    start = "" if data_too else later(c)
    evidence = ["same batch, weights and lr, other gradients"] if not data_too else []
    evidence.append(f"the torch RNG state differs at step {c.step}")
    if c.rng_then_iterator() and not c.unsaved("global_rng"):
        evidence.append("the resumed run set the torch RNG state, then made a DataLoader iterator that drew from it")
        return (
            "rng_after_iterator",
            f"{start}the forward's randomness (dropout) is off: the RNG state was restored, "
            "then a DataLoader without generator= drew its base seed from it as its iterator was made",
            evidence,
        )
    if c.live("global_rng") and not c.unsaved("global_rng") and c.resumed_events("rng_set"):
        return (
            "rng_misplaced",
            f"{start}the forward's randomness (dropout) is off: the RNG state was saved and set back, but the "
            "straight run drew from it between the moment it was saved and the one the resumed run set it back "
            "at (a DataLoader iterator made, or a batch drawn, before the resumed run sets it back)",
            evidence,
        )
    return (
        "rng_lost",
        f"{start}the forward's randomness (dropout) was not restored: the RNG state was not saved",
        evidence,
    )


def batch_randomness(c: Context):
    """The batch itself is drawn from the torch RNG (a random collate_fn or dataset), which the resume
    restored only after the first batch was drawn."""
    if "batch" not in c.diff or c.index or "fetch" not in (c.straight.get("drew") or []):
        return None
    late = [e for e in c.resumed_events("rng_set") if e.get("fetched")]
    if not late:
        return None
    headline = (
        "the batch draws random numbers from the torch RNG (in the dataset or the collate_fn), and the resumed run "
        "restored the RNG state only after it had drawn its first batch: that batch, and every random draw after it, "
        "differ from the straight run's"
    )
    fetched = late[0]["fetched"]
    evidence = [f"the resumed run set the torch RNG state after it had fetched {fetched} batch(es) for step {c.step}"]
    return "batch_randomness", headline, evidence


def optimizer(c: Context):
    if "optim" not in c.diff:
        return None
    a, b = c.straight.get("optim_step"), c.resumed.get("optim_step")
    evidence = (
        [f"the optimizer's step counter is {b:g} in the resumed run, {a:g} in the straight one"] if a and b else []
    )
    fresh = " (a fresh optimizer: moments and step counter start from zero)" if b == c.index + 1 else ""
    unsaved = " not saved in the checkpoint" if c.unsaved("optimizer") else " not restored"
    return "optimizer_lost", f"{later(c)}the optimizer state was{unsaved}{fresh}", evidence


def scaler(c: Context):
    if "scaler" not in c.diff:
        return None
    a, b = c.straight.get("scale"), c.resumed.get("scale")
    evidence = [f"loss scale {b[0]:g} in the resumed run, {a[0]:g} in the straight one"] if a and b else []
    return "scaler_lost", f"{later(c)}the GradScaler's state (scale, growth tracker) was not restored", evidence
