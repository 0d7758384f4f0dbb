"""A TrainConfig as command-line flags: how the lab passes each of its training runs its config.

config_flags(config)   the flags that parse back to `config` (commands/config_flags.py parses them)
flag_name(field)       a field's flag: --NAME in kebab case
"""

from __future__ import annotations

from dataclasses import Field, fields

from exactresume.config import TrainConfig


def flag_name(field: Field) -> str:
    return "--" + field.name.replace("_", "-")


def config_flags(config: TrainConfig) -> list[str]:
    """The flags that parse back to `config`, every field spelled out."""
    flags = []
    for field in fields(TrainConfig):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            flags.append(flag_name(field) if value else "--no-" + flag_name(field)[2:])
        else:
            # repr of a float is the shortest text that reads back as the same float
            flags += [flag_name(field), repr(value) if isinstance(value, float) else str(value)]
    return flags
