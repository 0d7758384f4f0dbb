"""The fingerprints of one optimizer step, each computed on its own (one that fails leaves the others).

Parameters, gradients and optimizer state are read in the models' own order (named_parameters()), not in
the optimizer's: an optimizer whose param groups list the same parameters in another order then shows
only as another `layout` (the names in each group), and its state, loaded by position onto other
parameters, as that. Parameters no model names follow in the optimizer's order.
"""

from __future__ import annotations

import sys
import weakref

from . import fingerprint as fp


class Order:
    """One optimizer's parameters in the models' order, and its groups' parameter names, remade when its
    parameters or the models seen change."""

    def __init__(self):
        self.made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (key, params, layout)

    def of(self, optimizer, models) -> tuple[list, str, list[list[str]]]:
        groups = [list(g["params"]) for g in optimizer.param_groups]
        key = (tuple(id(p) for group in groups for p in group), len(models))
        found = self.made.get(optimizer)
        if found is None or found[0] != key:
            found = (key, *ordered(groups, models))
            self.made[optimizer] = found
        return found[1], found[2], found[3]


def ordered(groups: list[list], models) -> tuple[list, str, list[list[str]]]:
    """The parameters by their place in the model that holds them (unnamed ones last, in the optimizer's
    order), the layout's digest and the names in each group. Every module that trains is among `models`
    (a set: no order): a parameter belongs to the largest that holds it, under its longest name (a wrapper's)."""
    best: dict[int, tuple] = {}  # id(p) -> (size, name, position, model)
    for model in list(models):
        own = list(model.named_parameters())
        for position, (name, p) in enumerate(own):
            found = (len(own), len(name), name, position, id(model))
            best[id(p)] = max(best.get(id(p), found), found)
    flat = [p for group in groups for p in group]
    first: dict[int, int] = {}  # a model -> where its first parameter is in the optimizer
    for index, p in enumerate(flat):
        if id(p) in best:
            first.setdefault(best[id(p)][4], index)
    rank = {id(p): (first[best[id(p)][4]], best[id(p)][3]) for p in flat if id(p) in best}
    params = [p for _, p in sorted(enumerate(flat), key=lambda ip: rank.get(id(ip[1]), (len(flat), ip[0])))]
    layout = [
        [best[id(p)][2] if id(p) in best else f"group{g}[{i}]" for i, p in enumerate(group)]
        for g, group in enumerate(groups)
    ]
    return params, fp.digest(layout), layout


def settings(tracer, optimizer, params) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "lr": [float(g.get("lr", 0.0)) for g in groups],
        "hparams": fp.settings_digest([{k: v for k, v in g.items() if k != "lr"} for g in groups]),
    }


def weights(tracer, optimizer, params) -> dict:
    """The weights' fingerprint, and their sample appended to the weights file (`sample`: its length)."""
    found, sample = fp.digest(params), fp.weight_sample(params)
    if sample.numel():
        tracer.weights.write(fp.raw(sample))
    return {"params": found, "sample": sample.numel()}


def data(tracer, optimizer, params) -> dict:
    rows = tracer.live.data_state()
    return {
        "data": fp.digest(rows),
        "sampler_epochs": [row[1] for row in rows],
        "generators": [state for row in rows for state in row[2]],
    }


def scalers(tracer, optimizer, params) -> dict:
    enabled = [s for s in list(tracer.live.scalers) if s.is_enabled()]
    return {"scaler": fp.digest([s.state_dict() for s in enabled]), "scale": [float(s.get_scale()) for s in enabled]}


def _rngs(tracer, optimizer, params) -> dict:
    found = fp.rng_digests()
    tracer.live.rng_seen.append(found["rng_torch"])
    return found


def sources(tracer, optimizer, params) -> dict:
    """Each random.Random, numpy Generator and torch.Generator the script holds (sources.py)."""
    return tracer.sources.digests(list(tracer.live.loaders), sys._getframe(1))


def buffers(live) -> dict:
    """The trained models' saved buffers (a BatchNorm's running statistics) after the step's forward: state a
    step changes besides the weights, and that a forward may read."""
    return {"buffers": live.buffers()}


BEFORE_STEP = (
    ("the lr and hyperparameters", settings),
    ("the weights", weights),
    ("the sampler's state", data),
    ("the GradScalers' state", scalers),
    ("the RNG states", _rngs),
    ("the random sources", sources),
)


def gradients(params) -> dict:
    return {"grads": fp.digest([p.grad for p in params])}


def optimizer_state(optimizer, params) -> dict:
    states = [optimizer.state[p] for p in params if p in optimizer.state]
    counters = [float(s["step"]) for s in states[:1] if "step" in s]
    return {"optim": fp.digest(states), "optim_step": counters[0] if counters else None}
