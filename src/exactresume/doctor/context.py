"""What a cause's rule reads: the first resumed step where the runs part, with the runs, the files saved at
the resume step and the files the resumed run loaded; and the phrases several rules share.
"""

from __future__ import annotations

from dataclasses import dataclass

from exactresume.doctor.examine import Runs


@dataclass
class Context:
    runs: Runs
    index: int  # 0 at the first resumed step
    straight: dict
    resumed: dict
    diff: list[str]
    ahead: int | None = None  # the first step where only a sampler's or an RNG's state differed

    @property
    def step(self) -> int:
        return self.runs.resume_step + self.index + 1

    def loaded(self) -> list[dict]:
        paths = {load["path"] for load in self.runs.resumed.loads}
        return [f for f in self.runs.files if f["path"] in paths]

    def unsaved(self, kind: str) -> list[dict]:
        """The live objects of `kind` that none of the files saved at the resume step holds."""
        rows = self.live(kind)
        saved = {r["name"] for r in rows if r["saved"]}
        return [r for r in rows if r["name"] not in saved]

    def live(self, kind: str) -> list[dict]:
        return [r for f in self.runs.files for r in f["live"] or [] if r["kind"] == kind]

    def draws(self) -> bool:
        """Whether the model draws random numbers in its forward (a dropout), as the checkpoint was saved."""
        return any(f.get("dropout") for f in self.runs.files)

    def resumed_events(self, kind: str) -> list[dict]:
        """The resumed run's `kind` events before its first step, in order (iterators made, RNG states set)."""
        return [e for e in self.runs.resumed.first.events if e["event"] == kind and e["step"] == 0]

    def rng_then_iterator(self) -> bool:
        """The resumed run set the torch RNG, then a DataLoader drew from it as its iterator was made."""
        events = [e for e in self.runs.resumed.first.events if e["step"] == 0]
        sets = [i for i, e in enumerate(events) if e["event"] == "rng_set"]
        return bool(sets) and any(e["event"] == "iter" and e["drew"] for e in events[sets[0] :])

    def straight_step_with(self, name: str, value) -> int | None:
        """The first straight step whose fingerprint `name` equals `value`."""
        return next((s["step"] for s in self.runs.straight.steps if s.get(name) == value), None)


def later(c: Context) -> str:
    """How a cause found after the first resumed step begins: where the runs were still equal."""
    if c.index == 0:
        return ""
    steps = c.runs.straight.steps
    epochs = [s.get("sampler_epochs") for s in steps[c.step - 2 : c.step]]
    boundary = " (an epoch boundary)" if len(epochs) == 2 and epochs[0] != epochs[1] else ""
    return f"equal through step {c.step - 1}, then at step {c.step}{boundary}: "


def steps(count: int, where: str) -> str:
    return f"{count} step{'s' if count != 1 else ''} {where}"


def position_evidence(c: Context) -> list[str]:
    found = c.straight_step_with("batch", c.resumed["batch"])
    if found == 1:
        return [f"restarted from the first batch: the resumed step {c.step} drew step 1's batch"]
    if found:
        gap = steps(c.step - found, "back") if found < c.step else steps(found - c.step, "ahead")
        return [f"the resumed step {c.step} drew the batch of step {found} ({gap})"]
    return [f"the resumed step {c.step} drew a batch the straight run never drew: the order was reshuffled"]
