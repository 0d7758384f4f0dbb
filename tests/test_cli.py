"""The command line itself: flags made from TrainConfig's fields and back, grouped --help, the
command list, --version."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from exactresume import __version__
from exactresume.atomic import write_json
from exactresume.cli import COMMANDS, build_parser
from exactresume.commands.config_flags import GROUPS, config_from_args, flag_name
from exactresume.config import TrainConfig
from exactresume.lab.lab import LabConfig, _train_flags
from exactresume.lab.record import run_record
from helpers import assert_one_line_error, call_cli

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


def typed(config: TrainConfig) -> list[str]:
    """Every field of `config` as a user types its flag (repr: a float's every bit)."""
    flags = []
    for field in fields(TrainConfig):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            flags.append(flag_name(field) if value else "--no-" + flag_name(field)[2:])
        else:
            flags += [flag_name(field), repr(value) if isinstance(value, float) else str(value)]
    return flags


CONFIG_IDS = lambda c: next((k for k, v in c.to_dict().items() if v != getattr(TrainConfig(), k)), "defaults")  # noqa: E731


@pytest.mark.parametrize("command", RUN_COMMANDS)
@pytest.mark.parametrize("config", configs(), ids=CONFIG_IDS)
def test_config_flags_parse_back_to_the_same_config(command, config):
    args = build_parser().parse_args([command, "--out", "x", *typed(config)])
    assert config_from_args(args) == config


@pytest.mark.parametrize("config", configs(), ids=CONFIG_IDS)
def test_a_config_file_gives_the_same_config_and_a_flag_typed_beside_it_wins(tmp_path, config):
    write_json(tmp_path / "run.json", config.to_dict())
    args = build_parser().parse_args(["train", "--out", "x", "--config", str(tmp_path / "run.json")])
    assert config_from_args(args) == config
    write_json(tmp_path / "some.json", {"steps": 90, "lr": 1})  # the rest default; an int for a float
    args = build_parser().parse_args(["train", "--out", "x", "--config", str(tmp_path / "some.json"), "--steps", "70"])
    assert config_from_args(args) == TrainConfig(steps=70, lr=1.0)


def test_the_lab_hands_its_runs_its_config_through_its_run_record(tmp_path):
    lab = LabConfig(train=replace(TrainConfig(), seed=3, lr=1 / 3, dtype="bf16"), out=tmp_path, nproc=2)
    (tmp_path / "details").mkdir()
    write_json(tmp_path / "details" / "run.json", run_record(lab))
    flags = _train_flags(lab)
    assert not any(flag_name(field) in flags for field in fields(TrainConfig))
    args = build_parser().parse_args(["train", "--out", "x", *flags])
    assert config_from_args(args) == lab.train and args.nproc == 2 and args.data == lab.data


@pytest.mark.parametrize(
    "text, needles",
    [
        (None, ("--config", "cannot read it", "No such file")),
        ("{steps: 3", ("--config", "not a JSON file")),
        ("[1, 2]", ("holds a list, not an object of the run's fields",)),
        ('{"step": 3}', ("step is not a field of the run (they are seed, steps,",)),
        ('{"steps": "60"}', ("steps must be an int, got a str",)),
        ('{"lr": true}', ("lr must be a float, got a bool",)),
        (
            '{"dtype": "fp8"}',
            (
                "--config",
                "dtype must be one of fp32, bf16, fp16",
            ),
        ),
        ('{"steps": -5}', ("--config", ": steps must be at least 1, got -5")),  # the file's name, not --steps
        ('{"data": 1, "out": 2}', ("data, out are not fields of the run",)),
    ],
)
def test_a_config_file_that_is_not_one_is_refused_in_one_line_and_nothing_is_written(tmp_path, text, needles):
    if text is not None:
        (tmp_path / "run.json").write_text(text)
    finished = call_cli("train", "--out", tmp_path / "out", "--config", tmp_path / "run.json", "--data", tmp_path)
    assert_one_line_error(finished, *needles)
    assert not (tmp_path / "out").exists()


def test_a_negative_keep_is_refused_in_the_flags_words(tmp_path):
    finished = call_cli("train", "--out", tmp_path / "out", "--data", tmp_path, "--save-every", 2, "--keep", -1)
    assert_one_line_error(finished, "--keep must be a number of checkpoints (0: all of them), got -1")
    assert not (tmp_path / "out").exists()


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


@pytest.mark.parametrize("columns", ["60", "70", "80"])
def test_help_never_cuts_a_quoted_flag_at_its_dashes(monkeypatch, columns):
    """argparse wraps with textwrap, which cuts at hyphens: `'--from_resume 1'` was shown as `'--`, then
    `from_resume 1'` on the next line."""
    monkeypatch.setenv("COLUMNS", columns)
    for name, parser in subparsers().items():
        shown = parser.format_help()
        cut = re.search(r"('-+|\w-)$", shown, re.MULTILINE)  # a quoted flag after its dashes, a flag at a hyphen
        assert not cut, (name, shown)
    assert "'--from_resume 1'" in subparsers()["doctor"].format_help()


def test_help_of_one_command_and_version():
    finished = call_cli("help", "train")
    assert finished.returncode == 0 and "training features:" in finished.stdout and "--stop-at" in finished.stdout
    finished = call_cli("--version")
    assert finished.returncode == 0 and finished.stdout == f"exactresume {__version__}\n"


def test_a_bad_config_value_is_one_line():
    finished = call_cli("train", "--out", "x", "--grad-clip", "0")
    assert finished.returncode == 2 and len(finished.stderr.splitlines()) == 1 and "--grad-clip" in finished.stderr
    assert "--weight-decay" not in finished.stderr  # only the flag typed wrong


def test_a_flag_is_typed_whole_and_an_abbreviation_is_refused_in_one_line(tmp_path):
    """`--stop 4` would be --stop-at today and ambiguous once another --stop... flag exists: no command takes it."""
    for command, meant in (
        (["train", "--out", tmp_path / "run", "--stop", "4"], "--stop-at?"),
        (["lab", "--out", tmp_path / "lab", "--ste", "8"], "--steps?"),
    ):
        assert_one_line_error(call_cli(*command), "unrecognized arguments", command[-2], f"typed whole: {meant}")
    assert not list(tmp_path.iterdir())


def test_a_mistyped_flag_or_command_is_refused_naming_the_one_it_is_near(tmp_path):
    for command, said in (
        (
            ["train", "--out", tmp_path / "run", "--stop_at", "4"],
            "unrecognized arguments: --stop_at 4 (did you mean --stop-at?)",
        ),
        (["lab", "--out", tmp_path / "lab", "--seq_len", "8"], "(did you mean --seq-len?)"),
        (["tran", "--out", tmp_path / "run"], "invalid choice: 'tran' (choose from 'prepare', 'train',"),
        (["tran", "--out", tmp_path / "run"], "'help') (did you mean train?)"),
        (["export", tmp_path / "x.pth", "--dtype", "fp-16"], "(did you mean fp16?)"),
        (["train", "--out", tmp_path / "run", "--preset", "Tiny"], "(did you mean tiny?)"),
        (
            ["train", "--out", tmp_path / "run", "--resume", "aut"],
            "--resume: no file or folder aut (did you mean auto?)",
        ),
    ):
        assert_one_line_error(call_cli(*command), said)
    for command in (
        ["train", "--out", tmp_path / "run", "--xyz", "4"],
        ["export", tmp_path / "x.pth", "--dtype", "fp8"],
    ):
        assert "did you mean" not in call_cli(*command).stderr  # nothing near enough: no guess
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["train", "lab", "prepare", "diff", "export", "ablate"])
def test_json_and_quiet_together_are_refused_in_one_line(command, tmp_path):
    """One asks for the summary, the other for none: refused before anything is read or written."""
    refused = call_cli(command, "--json", "--quiet", *(["--out", tmp_path / "out"] if command != "diff" else []))
    assert_one_line_error(refused, "--quiet: not allowed with argument --json")
    assert not (tmp_path / "out").exists()


def test_resume_auto_help_names_where_it_reads():
    finished = call_cli("help", "train")
    text = " ".join(finished.stdout.split())  # argparse wraps the help at any space
    assert "the newest valid checkpoint in --checkpoints (default OUT/checkpoints)" in text, text


def test_a_reader_that_leaves_early_ends_it_quietly_as_sigpipe_would():
    """`exactresume | head`: the pipe closed before the command wrote its list; no traceback, the shell's 141."""
    command = [sys.executable, "-m", "exactresume"]
    started = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started.stdout.close()  # before it has written anything: its first write meets a closed pipe
    stderr = started.stderr.read().decode()
    assert started.wait() == 128 + signal.SIGPIPE and stderr == "", stderr
