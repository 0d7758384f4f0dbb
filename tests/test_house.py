"""The house's rules, checked with the project's own tools: the public API, names every tool can see,
one concept per module (said in its docstring's first line), short functions, a module's own functions
private, and flags read only by the commands."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import exactresume
from exactresume.config import TrainConfig
from exactresume.errors import FieldError
from helpers import assert_one_line_error, call_cli

PACKAGE = Path(exactresume.__file__).resolve().parent
MAX_FUNCTION_LINES = 50
# Where a command's flags are read: the commands (one module each) and the fork server's own script.
READS_FLAGS = ("cli.py", "commands/", "forkserver/serve.py")


def test_the_public_api_is_what_the_package_exports():
    assert exactresume.__all__ == sorted(set(exactresume.PUBLIC) - set(exactresume.NEEDS_LAB))
    for name in exactresume.PUBLIC:
        assert getattr(exactresume, name) is not None, name
    with pytest.raises(AttributeError):
        exactresume.CheckpointStor  # noqa: B018 - a typo names itself, it is not sent elsewhere
    from torch.distributed.checkpoint.stateful import Stateful

    assert exactresume.Stateful is Stateful  # PyTorch's own part protocol


def test_the_built_in_trainers_names_are_its_own_not_the_librarys():
    import exactresume.trainer

    assert exactresume.trainer.__all__ == sorted(exactresume.trainer.PUBLIC)
    for name in exactresume.trainer.PUBLIC:
        assert getattr(exactresume.trainer, name) is not None, name
        assert name not in exactresume.PUBLIC, name
    assert len(exactresume.PUBLIC) <= 25  # the library's: the store, one-file calls, parts, errors, world, lines


def test_importing_the_package_is_light_and_old_module_paths_are_gone():
    script = (
        "import sys, importlib, exactresume\n"
        "assert 'torch' not in sys.modules\n"
        "for old in ('exactresume.checkpoint', 'exactresume.model', 'exactresume.dist', 'exactresume._moved'):\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(old + ' imports')\n"
        "assert not any(type(finder).__module__.startswith('exactresume') for finder in sys.meta_path)\n"
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr


def test_no_folder_or_module_is_named_like_a_build_folder_or_the_standard_library():
    for path in PACKAGE.rglob("*"):
        if path.is_dir():
            assert path.name not in ("dist", "build"), path
        elif path.suffix == ".py" and path.stem != "__init__":
            assert path.stem not in sys.stdlib_module_names or path.stem == "sitecustomize", path


def test_every_module_says_its_one_concept_and_no_function_is_over_50_lines():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree, name = ast.parse(path.read_text()), path.relative_to(PACKAGE)
        docstring = ast.get_docstring(tree)
        assert docstring and docstring.split("\n\n")[0].strip().endswith((".", ":")), f"{name}: what it is, first"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= MAX_FUNCTION_LINES, f"{name}:{node.lineno} {node.name}: {lines}"


def test_a_module_level_function_no_other_file_names_is_private():
    """What a module offers the others has no leading underscore; what only it calls has one. Named
    elsewhere: by another module, a test, a benchmark or the docs."""
    root = PACKAGE.parents[1]
    files = [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "bench").rglob("*.py")]
    files += [
        *(root / "docs").rglob("*.md"),
        *(root / "docs").rglob("*.py"),
        root / "README.md",
        root / "pyproject.toml",
    ]
    words = {path: set(re.findall(r"\w+", path.read_text())) for path in files if path.is_file()}
    lonely = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                if not any(node.name in found for other, found in words.items() if other != path):
                    lonely.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert lonely == [], lonely


def layer_of(module: str, layers: list[str]) -> int | None:
    """The floor of `module` in the import linter's layers (0 the top), None for the package's own files."""
    for floor, rooms in enumerate(layers):
        if any(module == room or module.startswith(room + ".") for room in map(str.strip, rooms.split("|"))):
            return floor
    return None


def test_no_module_names_a_higher_one_in_a_string():
    """The import linter sees imports; a module named in a string (for import_module, a fork server's
    preload, a `python -m`) is a tie it cannot see, so none may point up the house."""
    root = PACKAGE.parents[1]
    layers = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        floor = layer_of(module, layers)
        tree = ast.parse(path.read_text())
        documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        documented = [node for node in ast.walk(tree) if isinstance(node, documented)]
        docstrings = {id(node.body[0].value) for node in documented if ast.get_docstring(node, clean=False)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for named in re.findall(r"exactresume(?:\.\w+)+", node.value):
                    named_floor = layer_of(named, layers)
                    if floor is not None and named_floor is not None and named_floor < floor:
                        upward.append(f"{module}:{node.lineno} names {named}")
    assert upward == [], upward


def test_no_module_below_the_commands_reads_flags():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(READS_FLAGS):
            continue
        imported = {
            alias.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        assert "argparse" not in imported, f"{name} reads flags: a command's job or plan is what it takes"


def test_a_library_caller_meets_field_names_and_the_command_line_its_flags(tmp_path):
    with pytest.raises(FieldError, match=r"^seq_len must be at least 1, got 0$"):
        TrainConfig(seq_len=0)
    finished = call_cli("train", "--out", tmp_path, "--seq-len", "0")
    assert_one_line_error(finished, "--seq-len must be at least 1, got 0")
