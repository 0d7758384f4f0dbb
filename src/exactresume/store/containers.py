"""What DCP's index forgets of a state's containers, recorded beside the state and put back on load.

DCP flattens a state to one name per value: a dict's keys become strings (`{0: ...}` is saved under
"0"), a tuple is walked as a list, and an empty dict, list or tuple holds no value, so it leaves no
name. dcp.load reads into a state the caller built, whose containers are already right; a sharded
checkpoint here is read whole, its containers rebuilt from the names alone. Without this record,
torch's own optimizer state (keyed by parameter index: `state[0]`) came back keyed "0", which
`load_state_dict` takes for no parameter's: every moment silently dropped. So a sharded save records,
as one string beside the parts (`CONTAINERS_KEY`), each dict's keys that are not strings, each tuple
and each empty container, by their paths as DCP names them; a load puts them back as saved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from exactresume.errors import UserError

CONTAINERS_KEY = "exactresume_containers"
KEY_TYPES = (int, float, bool, type(None))  # keys DCP turns into strings that literal_eval reads back
EMPTY = {"dict": dict, "list": list, "tuple": tuple}


def record_containers(state: dict) -> str:
    """The record of `state`'s containers (keys not strings, tuples, empties), as a literal string."""
    keys, tuples, empties = [], [], []
    for path, node in _containers(state, ()):
        if isinstance(node, dict):
            _check_keys(path, node)
            others = [key for key in node if not isinstance(key, str)]
            if others:
                keys.append((path, others))
        if isinstance(node, tuple):
            tuples.append(path)
        if not node and path:
            empties.append((path, type(node).__name__))
    return repr({"keys": keys, "tuples": tuples, "empty": empties})


def restore_containers(state: dict, record: object) -> dict:
    """`state` as DCP rebuilt it, its containers put back as `record` says (a checkpoint without one: as it is).

    What DCP pickled whole (a tuple, a list of plain values) came back as it was saved; each change
    below applies only where a container is as DCP's names rebuild it (a dict keyed by text, a list)."""
    if not isinstance(record, str):
        return state
    saved = ast.literal_eval(record)
    for path, kind in saved["empty"]:  # first: a dict that held only empties left no name either
        parent = parent_made(state, path)
        if isinstance(parent, dict | list):
            slot(parent, path[-1], EMPTY[kind]())
    # The deepest first, so that each path is walked through containers as DCP named them (keys as text).
    changes = [(path, keys) for path, keys in saved["keys"]] + [(path, None) for path in saved["tuples"]]
    for path, keys in sorted(changes, key=lambda change: -len(change[0])):
        node, parent = _find(state, path), _find(state, path[:-1]) if path else None
        if keys is None and isinstance(node, list) and isinstance(parent, dict | list):
            slot(parent, path[-1], tuple(node), replace=True)
        elif keys is not None and isinstance(node, dict):
            for key in keys:
                if str(key) in node:
                    node[key] = node.pop(str(key))
    return state


def _containers(node: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    """Every dict, list and tuple in `node`, with its path as DCP names it (a dict's keys as strings)."""
    if isinstance(node, dict | list | tuple):
        yield path, node
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for step, value in items:
            yield from _containers(value, (*path, str(step) if isinstance(node, dict) else step))


def _check_keys(path: tuple, node: dict) -> None:
    """UserError for a key DCP cannot name apart or that the record cannot hold, before a byte is written."""
    where, seen = ".".join(map(str, path)), {}
    for key in node:
        if not isinstance(key, (str, *KEY_TYPES)):
            raise UserError(
                f"a sharded checkpoint keys its dicts by strings, numbers, booleans or None; {where} has a key "
                f"of type {type(key).__name__} ({key!r})"
            )
        if str(key) in seen:
            raise UserError(
                f"a sharded checkpoint names each value by its keys as text, and {where} has two keys written "
                f"{str(key)!r} ({seen[str(key)]!r} and {key!r})"
            )
        seen[str(key)] = key


def _child(node: Any, step: Any) -> Any:
    if isinstance(node, dict):
        return node.get(step)
    return node[step] if isinstance(step, int) and step < len(node) else None


def slot(node: dict | list, step: str | int, value: Any, replace: bool = False) -> Any:
    """node[step], set to `value` if missing (or always with `replace`); lists grow as needed."""
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
        if replace or node[step] is None:
            node[step] = value
        return node[step]
    if replace or step not in node:
        node[step] = value
    return node[step]


def _find(state: Any, path: tuple) -> Any:
    """What is at `path`, or None where the path leads nowhere."""
    node = state
    for step in path:
        node = _child(node, step) if isinstance(node, dict | list | tuple) else None
        if node is None:
            return None
    return node


def parent_made(state: dict, path: tuple) -> Any:
    """The container holding `path`'s last step, made where missing (a list where the next step is an index);
    None where the path goes through a value DCP pickled whole."""
    node = state
    for step, following in zip(path[:-1], path[1:]):
        if not isinstance(node, dict | list):
            return None
        node = slot(node, step, [] if isinstance(following, int) else {})
    return node
