"""The command line itself: flags made from TrainConfig's fields and back, grouped --help, the
command list, --version."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace

import pytest

from exactresume import __version__
from exactresume.cli import COMMANDS, build_parser
from exactresume.commands.config_flags import GROUPS, config_from_args
from exactresume.config import TrainConfig
from exactresume.flags import config_flags, flag_name
from exactresume.lab.lab import LabConfig, _train_flags
from helpers import call_cli

RUN_COMMANDS = ("train", "lab", "ablate")
FLAG_LINE = re.compile(r"^  (-{1,2}[\w-]+)(?:, (--[\w-]+))?")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def changed(field) -> object:
    """A valid value other than the default, for any field of TrainConfig."""
    if field.metadata.get("choices"):
        return field.metadata["choices"][-1]
    if isinstance(field.default, float):
        return field.default + 1 / 30  # no short decimal: the flag must carry every bit
    return field.default + 1


def configs() -> list[TrainConfig]:
    """The defaults, then each field changed on its own (workers needs the epoch loader)."""
    out = [TrainConfig()]
    for field in fields(TrainConfig):
        extra = {"loader": "epoch"} if field.name == "workers" else {}
        out.append(replace(TrainConfig(), **{field.name: changed(field)}, **extra))
    return out


@pytest.mark.parametrize("command", RUN_COMMANDS)
@pytest.mark.parametrize(
    "config",
    configs(),
    ids=lambda c: next((k for k, v in c.to_dict().items() if v != getattr(TrainConfig(), k)), "defaults"),
)
def test_config_flags_parse_back_to_the_same_config(command, config):
    args = build_parser().parse_args([command, "--out", "x", *config_flags(config)])
    assert config_from_args(args) == config


def test_every_field_is_a_flag_and_the_lab_passes_every_field():
    lab = LabConfig(train=replace(TrainConfig(), seed=3, lr=1 / 3, dtype="bf16"), nproc=2)
    flags = _train_flags(lab)
    for field in fields(TrainConfig):
        assert flags.count(flag_name(field)) == 1, field.name
    args = build_parser().parse_args(["train", "--out", "x", *flags])
    assert config_from_args(args) == lab.train and args.nproc == 2 and args.data == lab.data


def help_sections(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """The flags --help shows, by the heading they are shown under."""
    sections, heading = {}, None
    for line in parser.format_help().splitlines():
        if re.fullmatch(r"[\w ]+:", line):
            heading = line[:-1]
            sections[heading] = []
        elif heading and (match := FLAG_LINE.match(line)):
            sections[heading] += [flag for flag in match.groups() if flag]
    return sections


@pytest.mark.parametrize("command", RUN_COMMANDS)
def test_every_flag_in_help_belongs_to_exactly_one_group(command):
    parser = subparsers()[command]
    sections = help_sections(parser)
    shown = [flag for flags in sections.values() for flag in flags]
    every = [option for action in parser._actions for option in action.option_strings]
    assert sorted(shown) == sorted(every)  # each flag shown once, under one heading
    assert set(sections) - {"options"} <= set(GROUPS) and sections["options"] == ["-h", "--help"]
    for field in fields(TrainConfig):  # the group is the one the field's metadata names
        assert flag_name(field) in sections[field.metadata["group"]], field.name


def test_no_command_and_help_list_every_command_with_an_example():
    for args in ((), ("help",)):
        finished = call_cli(*args)
        assert finished.returncode == 0 and finished.stderr == ""
        for name, (what, example) in COMMANDS.items():
            assert re.search(rf"^  {name} +{re.escape(what)}$", finished.stdout, re.MULTILINE), name
            assert example in finished.stdout
        assert set(COMMANDS) == set(subparsers())


def test_help_of_one_command_and_version():
    finished = call_cli("help", "train")
    assert finished.returncode == 0 and "training features:" in finished.stdout and "--stop-at" in finished.stdout
    finished = call_cli("--version")
    assert finished.returncode == 0 and finished.stdout == f"exactresume {__version__}\n"


def test_a_bad_config_value_is_one_line():
    finished = call_cli("train", "--out", "x", "--grad-clip", "0")
    assert finished.returncode == 2 and len(finished.stderr.splitlines()) == 1 and "--grad-clip" in finished.stderr


def test_resume_auto_help_names_where_it_reads():
    finished = call_cli("help", "train")
    text = " ".join(finished.stdout.split())  # argparse wraps the help at any space
    assert "the newest valid checkpoint in --checkpoints (default OUT/checkpoints)" in text, text
