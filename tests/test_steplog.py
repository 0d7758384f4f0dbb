"""The log rule: an existing log keeps its rows up to the resumed step; a new one holds this process's rows."""

from __future__ import annotations

import pytest

from exactresume.core.steplog import LOSS_HEADER, StepLog
from exactresume.errors import UserError

ROWS = "step,train_loss\n1,8.000000\n2,7.500000\n3,7.000000\n4,6.500000\n"


def continue_log(path, resumed_step, steps):
    log = StepLog(path, LOSS_HEADER, resumed_step).open()
    for step in steps:
        log.append(step, f"{10 - step:.6f}")
    log.close()
    return path.read_text()


def test_new_log_holds_only_this_process_rows(tmp_path):
    assert continue_log(tmp_path / "log.csv", 30, [31, 32]) == "step,train_loss\n31,-21.000000\n32,-22.000000\n"


def test_existing_log_loses_rows_after_the_resumed_step(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(ROWS)
    assert continue_log(path, 2, [3]) == "step,train_loss\n1,8.000000\n2,7.500000\n3,7.000000\n"


def test_fresh_start_over_an_existing_log_keeps_only_the_header(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(ROWS)
    assert continue_log(path, 0, [1]) == "step,train_loss\n1,9.000000\n"


@pytest.mark.parametrize("tail", ["5,6.0", "5", "garbage\n"])
def test_a_half_written_last_row_is_dropped(tmp_path, tail):
    path = tmp_path / "log.csv"
    path.write_text(ROWS + tail)
    assert continue_log(path, 4, [5]) == ROWS + "5,5.000000\n"


@pytest.mark.parametrize("content", ["", "step,tr"])
def test_an_empty_or_cut_header_is_rewritten(tmp_path, content):
    path = tmp_path / "log.csv"
    path.write_text(content)
    assert continue_log(path, 0, [1]) == "step,train_loss\n1,9.000000\n"


def test_a_file_that_is_not_a_log_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("name,value\nimportant,1\n")
    with pytest.raises(UserError, match="not a step,train_loss log"):
        StepLog(path, LOSS_HEADER, 0)
    assert path.read_text() == "name,value\nimportant,1\n"
