"""The random sources a step's record fingerprints, in the user's words: what each is, and the fix in its
own API (`rng.getstate()` for a random.Random, `np.random.get_state()`, `g.get_state()`).

The global RNGs are `rng_torch`, `rng_numpy` and `rng_python`; every other source the tracer saw is
`src:LABEL`, LABEL being its name in the script and its kind, `sampler.rng (random.Random)`, or its kind
and the order it was made in, `random.Random #2` (tracer/sources.py).
"""

from __future__ import annotations

import re

from exactresume.doctor.tracer.sources import PREFIX

GLOBALS = {
    "rng_numpy": ("numpy's global RNG", "np.random.get_state()", "np.random.set_state(saved)"),
    "rng_python": ("Python's global random", "random.getstate()", "random.setstate(saved)"),
    "rng_torch": ("torch's global RNG", "torch.get_rng_state()", "torch.set_rng_state(saved)"),
    "rng_cuda": ("the CUDA RNG", "torch.cuda.get_rng_state_all()", "torch.cuda.set_rng_state_all(saved)"),
}
KINDS = {  # kind -> how the user calls it, its state's getter and setter on NAME
    "random.Random": ("the random.Random", "{}.getstate()", "{}.setstate(saved)"),
    "numpy.random.Generator": ("the numpy Generator", "{}.bit_generator.state", "{}.bit_generator.state = saved"),
    "numpy.random.RandomState": ("the numpy RandomState", "{}.get_state()", "{}.set_state(saved)"),
    "torch.Generator": ("the torch.Generator", "{}.get_state()", "{}.set_state(saved)"),
}
LABEL = re.compile(r"^(?P<name>.+) \((?P<kind>[\w.]+)\)$|^(?P<unnamed>[\w.]+) #(?P<order>\d+)$")


def parts(field: str) -> tuple[str, str | None]:
    """A source field's kind, and its name in the script (None where the tracer found none)."""
    found = LABEL.match(field.removeprefix(PREFIX))
    if found is None:
        return "", None
    if found["kind"]:
        return found["kind"], found["name"]
    return found["unnamed"], None


def describe(field: str) -> str:
    """'numpy's global RNG', 'the random.Random sampler.rng', 'the 2nd random.Random the script made'."""
    if field in GLOBALS:
        return GLOBALS[field][0]
    kind, name = parts(field)
    what = KINDS.get(kind, (f"the {kind}",))[0]
    if name:
        return f"{what} {name}"
    order = field.rsplit("#", 1)[-1]
    return f"{what} made {_ordinal(int(order))} by the script" if order.isdigit() else what


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def fix(field: str) -> str:
    """Save the source's state with the checkpoint and set it back on resume, in its own API."""
    if field in GLOBALS:
        _, get, put = GLOBALS[field]
    else:
        kind, name = parts(field)
        _, get, put = KINDS.get(kind, ("", "{}.get_state()", "{}.set_state(saved)"))
        get, put = get.format(name or "it"), put.format(name or "it")
    shuffled = field == "rng_python" or parts(field)[0] == "random.Random"
    in_place = "; a list it shuffles in place (random.shuffle(ids)) is state too: save it as the epoch began" * shuffled
    return (
        f"save {get} with the checkpoint, as it is when the checkpoint is taken (for an order drawn as each epoch "
        f"begins: as the epoch began), and {put} on resume before it is drawn from again{in_place}"
    )


def parted(diff: list[str]) -> list[str]:
    """The sources among `diff`: the script's own first, then numpy's and Python's global RNGs, torch's last
    (its state moves with every DataLoader iterator made without generator=, whatever the script draws)."""
    own = [f for f in diff if f.startswith(PREFIX)]
    return own + [f for f in ("rng_numpy", "rng_python", "rng_cuda", "rng_torch") if f in diff]
