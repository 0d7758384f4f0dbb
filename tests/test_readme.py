"""README.md and docs/: the generated lab blocks match the committed json, the layout matches the code,
the CLI reference matches the parser, the library example runs, and the README stays one short page
that links every page of docs/."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from exactresume.cli import build_parser
from exactresume.report.figures import FIGURES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_readme", ROOT / "docs" / "build_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section(text: str, title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_lab_block_is_what_the_renderer_makes_of_the_committed_json():
    builder = load_builder()
    block = builder.LAB_PAGE.read_text().split(builder.BEGIN, 1)[1].split(builder.END, 1)[0]
    assert block == "\n" + builder.render_block(builder.DOCS_LAB)
    for name in FIGURES:
        assert f"(lab/{name}.png)" in block
        assert (builder.DOCS_LAB / f"{name}.png").read_bytes().startswith(b"\x89PNG")


def test_first_screen_shows_the_labs_closing_summary_made_from_the_committed_json():
    builder = load_builder()
    block = README.split(builder.SUMMARY_BEGIN, 1)[1].split(builder.SUMMARY_END, 1)[0]
    assert block == "\n" + builder.render_summary_block(builder.DOCS_LAB)
    assert README.index(builder.SUMMARY_BEGIN) < README.index("\n## ", README.index("# exactresume") + 1)
    assert "resumed = straight: " in block


def subcommands() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_cli_reference_names_every_command_and_only_real_flags():
    reference = section((DOCS / "cli.md").read_text(), "CLI reference")
    commands = subcommands()
    for name in commands:
        assert f"`exactresume {name}" in reference, name
    for row in re.findall(r"^\| `exactresume (\w+)[^|]*\|.*$", reference, re.MULTILINE):
        assert row in commands
    parsers = [build_parser(), *commands.values()]  # the top parser holds --version
    known = {option for parser in parsers for action in parser._actions for option in action.option_strings}
    for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", reference)):
        assert flag in known, flag


def test_library_example_runs(tmp_path, kjv_folder, monkeypatch):
    page = (DOCS / "library.md").read_text()
    example = page.split("<!-- library-example:begin -->", 1)[1].split("<!-- library-example:end -->", 1)[0]
    code = example.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line and not line.startswith(("from ", "import "))]) <= 10
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "kjv").symlink_to(kjv_folder)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/library.md", "exec"), {})
    assert (tmp_path / "resume.pth").exists()


def test_the_layout_is_drawn_from_the_code():
    builder = load_builder()
    block = README.split(builder.LAYOUT_BEGIN, 1)[1].split(builder.LAYOUT_END, 1)[0]
    assert block == "\n" + builder.render_layout_block()
    for name in builder.layers():  # every layer of the import contract names a real package or module
        assert (builder.PACKAGE / name).is_dir() or (builder.PACKAGE / f"{name}.py").is_file(), name


def test_the_readme_is_one_short_page_that_links_every_page_of_docs():
    assert README.count("\n") <= 250
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in README, page.name
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).exists(), link
