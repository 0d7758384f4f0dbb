"""What the tracer does when its own work in a hook fails: the script never sees it.

Every hook runs its work through `Guard.attempt(what, ...)`: an exception there is caught and reported
once per `what` as a `lost` event, with the step fingerprints it leaves blind from the coming step on;
the hook calls what it wraps exactly as without the tracer, and the script goes on. The doctor
compares none of those fingerprints from that step on, and its verdict says so.

EXACTRESUME_DOCTOR_FAIL_FROM (for the doctor's own tests): each `what` fails once, the first time it is
attempted at or after that optimizer step, as a bug of the tracer's would.
"""

from __future__ import annotations

RNG = ("rng_torch", "rng_cuda", "rng_numpy", "rng_python")
EVERY = ("batch", "indices", "lr", "hparams", "params", "grads", "optim", "scaler", "data", "layout", "buffers", *RNG)

# What a hook looks at -> the step fingerprints that are blind without it.
SIGHT: dict[str, tuple[str, ...]] = {
    "the steps": EVERY,
    "the steps that train nothing": (),  # such a step is then counted, as before the check
    "the batch": ("batch",),
    "the loss": (),
    "the gradients": ("grads",),
    "the weights": ("params",),
    "the parameters' order": ("layout", "params", "grads", "optim"),  # the optimizer's order instead
    "the models' buffers": ("buffers",),
    "the lr and hyperparameters": ("lr", "hparams"),
    "the sampler's state": ("data",),
    "the DataLoaders": ("data",),
    "the GradScalers' state": ("scaler",),
    "the LR schedulers and GradScalers": ("scaler",),
    "the RNG states": RNG,
    "the random sources": (),  # a source missing from a step's record is not compared (diagnose.differing)
    "the samples read": ("indices",),
    "the optimizer state": ("optim",),
    "the closure's forward": ("batch", "grads"),
    "what drew from the torch RNG": (),
    "the torch RNG states set": (),
    "the checkpoints saved": (),
    "what the checkpoints hold": (),
    "the checkpoints loaded": (),
    "the files it writes": (),
}


class ForcedFailure(RuntimeError):
    """A hook's failure forced by EXACTRESUME_DOCTOR_FAIL_FROM."""


class Guard:
    """The tracer's side of a failing hook: `step` (optimizer steps taken) and `write(record)` are the
    tracer's; `fail_from` the step from which each hook fails once (tests only)."""

    step: int

    def __init__(self, fail_from: int | None = None):
        self.lost: set[str] = set()
        self.fail_from, self.forced = fail_from, set()

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def attempt(self, what: str, action, *args, default=None, **kwargs):
        """`action(*args, **kwargs)`, or `default` when it raises (the failure reported as lost sight of `what`)."""
        try:
            if self.fail_from is not None and self.step + 1 >= self.fail_from and what not in self.forced:
                self.forced.add(what)
                raise ForcedFailure(f"{what}: forced by EXACTRESUME_DOCTOR_FAIL_FROM={self.fail_from}")
            return action(*args, **kwargs)
        except Exception as error:
            self.lose(what, error)
            return default

    def lose(self, what: str, error: Exception) -> None:
        """Report the first failure of `what`: from the coming step on the doctor compares none of its fields."""
        if what in self.lost:
            return
        self.lost.add(what)
        try:
            reason = f"{type(error).__name__}: {error}"
        except Exception:  # an exception whose own str() fails
            reason = type(error).__name__
        fields = list(SIGHT.get(what, ()))
        try:
            self.write({"event": "lost", "what": what, "fields": fields, "step": self.step + 1, "error": reason})
        except Exception:  # the trace is closed already (a hook run by an atexit handler after ours)
            pass
