"""Command-line flags made from TrainConfig's fields, grouped for --help, and the config they parse to.

    add_config_flags(groups)   one flag per field: --NAME in kebab case; help, group, choices from its metadata
    config_from_args(args)     the TrainConfig those flags parsed to

A new TrainConfig field is one edit in config.py: its flag, its --help group and the lab's child
runs (flags.config_flags) follow from the field. The groups of a --help are named here, in the
order they are shown.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from exactresume.config import FEATURES_GROUP, RUN_GROUP, TrainConfig
from exactresume.flags import flag_name

CHECKPOINTS_GROUP = "checkpoints"
ABLATION_GROUP = "ablation"
OUTPUTS_GROUP = "outputs"
PROCESSES_GROUP = "many processes"
GROUPS = (RUN_GROUP, FEATURES_GROUP, CHECKPOINTS_GROUP, ABLATION_GROUP, OUTPUTS_GROUP, PROCESSES_GROUP)


def add_groups(parser: argparse.ArgumentParser, names: tuple[str, ...] = GROUPS) -> dict[str, argparse._ArgumentGroup]:
    """An argument group per name, in the order of GROUPS, for a command's --help."""
    return {name: parser.add_argument_group(name) for name in GROUPS if name in names}


def add_config_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """Every TrainConfig field as a flag, in the group its metadata names, defaulting to the field's default."""
    for field in fields(TrainConfig):
        meta = field.metadata
        kind = type(field.default)
        options: dict = {"default": field.default, "help": meta["help"]}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
        if meta.get("choices"):
            options["choices"] = meta["choices"]
        groups[meta["group"]].add_argument(flag_name(field), **options)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{field.name: getattr(args, field.name) for field in fields(TrainConfig)})
