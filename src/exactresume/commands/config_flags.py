"""Command-line flags made from TrainConfig's fields, grouped for --help, and the config they parse to.

    add_config_flags(groups)   one flag per field: --NAME in kebab case; help, group, choices from its
                               metadata; and --config FILE, the fields as JSON (a lab's details/run.json)
    config_from_args(args)     the TrainConfig they give: the defaults, the file's fields, the flags typed

A new TrainConfig field is one edit in config.py: its flag, its --help group and its place in a
config file follow from the field. The groups of a --help are named here, in the order they are shown.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import Field, fields
from pathlib import Path

from exactresume.config import FEATURES_GROUP, RUN_GROUP, TrainConfig
from exactresume.errors import FieldError, UserError, a_kind_of

CHECKPOINTS_GROUP = "checkpoints"
ABLATION_GROUP = "ablation"
OUTPUTS_GROUP = "outputs"
PROCESSES_GROUP = "many processes"
GROUPS = (RUN_GROUP, FEATURES_GROUP, CHECKPOINTS_GROUP, ABLATION_GROUP, OUTPUTS_GROUP, PROCESSES_GROUP)


def add_groups(parser: argparse.ArgumentParser, names: tuple[str, ...] = GROUPS) -> dict[str, argparse._ArgumentGroup]:
    """An argument group per name, in the order of GROUPS, for a command's --help."""
    return {name: parser.add_argument_group(name) for name in GROUPS if name in names}


def flag_name(field: Field) -> str:
    return "--" + field.name.replace("_", "-")


def add_config_flags(groups: dict[str, argparse._ArgumentGroup]) -> None:
    """Every TrainConfig field as a flag, in the group its metadata names; a flag not typed is absent
    from the parsed args (its value comes from --config, else the field's default)."""
    groups[RUN_GROUP].add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the run's fields as JSON, {\"steps\": 60, ...} or a lab's details/run.json; a flag typed wins",
    )
    for field in fields(TrainConfig):
        meta = field.metadata
        kind = type(field.default)
        options: dict = {"default": argparse.SUPPRESS, "help": meta["help"]}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
        if meta.get("choices"):
            options["choices"] = meta["choices"]
        groups[meta["group"]].add_argument(flag_name(field), **options)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config the command line gives: each field as typed, else from --config, else its default."""
    typed = {field.name: getattr(args, field.name) for field in fields(TrainConfig) if hasattr(args, field.name)}
    if not args.config:
        return TrainConfig(**typed)
    try:
        return TrainConfig(**_read_config_file(args.config) | typed)
    except FieldError as error:
        if set(error.fields) & set(typed):
            raise
        raise UserError(f"--config {args.config}: {error}") from None  # the file's field names, not flags


def _read_config_file(path: Path) -> dict:
    """TrainConfig's fields from a JSON file: an object of them, or a lab's run record (its config.train);
    one line for a file that cannot be read, is not JSON, or names a field that is not one or a value
    of another type."""
    try:
        values = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"--config {path}: cannot read it ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--config {path}: not a JSON file ({error})") from None
    if isinstance(values, dict) and isinstance(values.get("config"), dict) and "train" in values["config"]:
        values = values["config"]["train"]  # a lab's details/run.json
    if not isinstance(values, dict):
        raise UserError(f"--config {path}: holds {a_kind_of(values)}, not an object of the run's fields")
    known = {field.name: field for field in fields(TrainConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        named = f"{unknown[0]} is not a field" if len(unknown) == 1 else f"{', '.join(unknown)} are not fields"
        raise UserError(f"--config {path}: {named} of the run (they are {', '.join(known)})")
    return {name: _field_value(path, known[name], value) for name, value in values.items()}


def _field_value(path: Path, field: Field, value: object) -> object:
    kind = type(field.default)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:  # bool is an int to isinstance, not here
        raise UserError(f"--config {path}: {field.name} must be {a_kind_of(field.default)}, got {a_kind_of(value)}")
    return value
