"""Progress output: a redrawn bar on a terminal, plain periodic lines anywhere else, nothing with --quiet."""

from __future__ import annotations

import io
import re

from exactresume.progress import Progress, resolve_mode
from helpers import SMALL, call_cli, train_cli

LINE = re.compile(r"train: step (\d+)/8 loss \d+\.\d{4} (\d+\.\d+|-) steps/s")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_mode_is_a_bar_only_on_a_terminal():
    assert resolve_mode("auto", FakeTerminal()) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "lines"
    assert resolve_mode("none", FakeTerminal()) == "none"


def test_lines_mode_writes_first_and_last_step_and_no_carriage_return():
    stream = io.StringIO()
    progress = Progress(total=50, label="train", mode="lines", stream=stream, interval=3600)
    progress.begin(0)
    for step in range(1, 51):
        progress.update(step, loss=1.0 / step)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/50", "50/50"]
    assert "\r" not in stream.getvalue()
    assert re.fullmatch(r"train: step 50/50 loss 0\.0200 \d+\.\d\d steps/s", lines[-1])


def test_bar_mode_redraws_one_line_and_ends_it():
    stream = FakeTerminal()
    progress = Progress(total=4, label="train", mode="bar", stream=stream)
    progress.begin(2)  # a resumed run starts part way
    progress.update(3, loss=2.5)
    progress.update(4, loss=2.25)
    progress.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "step 4/4 loss 2.2500" in text and "|" + "█" * 24 + "|" in text


def test_training_output_is_plain_lines_when_not_a_terminal(tmp_path, kjv_folder):
    finished = train_cli(tmp_path, "--data", kjv_folder, *SMALL, check=True)  # stdout is a pipe
    assert "\r" not in finished.stdout
    progress = finished.stdout.split("\n\n", 1)[0]  # the closing summary follows after a blank line
    steps = [int(LINE.fullmatch(line).group(1)) for line in progress.splitlines()]
    assert steps[0] == 1 and steps[-1] == 8


def test_quiet_silences_progress(tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--quiet")
    assert finished.returncode == 0 and finished.stdout == "" and finished.stderr == ""
    assert (tmp_path / "final.pth").exists()
