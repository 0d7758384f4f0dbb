"""Each command's closing summary: what it says comes from the files it wrote, --json parses to the
same facts, a stopped run's summary names the command that continues it, --quiet prints nothing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from exactresume.report.figures import FIGURES
from exactresume.summaries import FIGURE_NAMES, aligned, continue_command, lab_summary, number, render_lab, table
from helpers import SMALL, TINY_TEXT, call_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, kjv_folder):
    """A small run stopped at step 4, and what its command printed."""
    out = tmp_path_factory.mktemp("stopped")
    finished = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--stop-at", 4, "--progress", "none")
    assert finished.returncode == 0, finished.stderr
    return out, finished.stdout


def test_a_stopped_run_names_its_resume_file_and_the_command_that_continues_it(stopped, kjv_folder):
    out, stdout = stopped
    lines = dict(line.split(None, 1) if " " in line else (line, "") for line in stdout.strip().splitlines())
    resume = out / "resume.pth"
    assert lines["step"].startswith("4 of 8, loss ") and "(stopped by --stop-at 4)" in lines["step"]
    assert f"{resume}  ({resume.stat().st_size:,} bytes)" in stdout
    assert f"{out / 'log.csv'}  ({(out / 'log.csv').stat().st_size:,} bytes, 4 rows)" in stdout
    command = stdout.split("continue with", 1)[1].strip()
    words = shlex.split(command)
    assert (
        words[:2] == ["exactresume", "train"] and "--stop-at" not in words and words[-2:] == ["--resume", str(resume)]
    )
    finished = call_cli(*words[1:], "--progress", "none")  # the printed command, run as printed
    assert finished.returncode == 0, finished.stderr
    assert "8 of 8" in finished.stdout and f"{out / 'final.pth'}  (" in finished.stdout


def test_json_is_the_only_thing_on_stdout_and_matches_the_files(stopped, kjv_folder, tmp_path):
    out, _ = stopped
    # a resume prints a note ("resumed from ..."): under --json it goes to stderr
    resume, divergence = ("--resume", out / "resume.pth"), ("--divergence", tmp_path / "d.csv")
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, *resume, *divergence, "--json")
    assert finished.returncode == 0, finished.stderr
    summary = json.loads(finished.stdout)
    assert summary["command"] == "train" and summary["step"] == 8 and summary["continue"] is None
    log_rows = (tmp_path / "log.csv").read_text().splitlines()[1:]
    assert summary["loss"] == float(log_rows[-1].split(",")[1]) and summary["files"]["log"]["rows"] == len(log_rows)
    assert summary["files"]["divergence"]["bytes"] == (tmp_path / "d.csv").stat().st_size
    assert summary["files"]["weights"] == {
        "path": str(tmp_path / "final.pth"),
        "bytes": (tmp_path / "final.pth").stat().st_size,
    }


def test_prepare_says_what_it_read_and_whether_it_reused_the_cache(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(TINY_TEXT)
    flags = ("prepare", "--corpus", corpus, "--vocab-size", 270, "--out", tmp_path / "data")
    first, again = (json.loads(call_cli(*flags, "--json").stdout) for _ in range(2))
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert (first["reused"], again["reused"]) == (False, True)
    assert (first["train_tokens"], first["val_tokens"]) == (manifest["train_tokens"], manifest["val_tokens"])
    assert [Path(f["path"]).name for f in first["files"]] == ["tokenizer.json", "train.npy", "val.npy", "manifest.json"]
    text = call_cli(*flags).stdout
    assert "reused" in text and f"{manifest['train_tokens']:,} train" in text and "exactresume train --data" in text


def test_diff_and_export_json_and_quiet(stopped, kjv_folder, tmp_path):
    out, _ = stopped
    finished = call_cli("diff", out / "resume.pth", out / "resume.pth", "--json")
    summary = json.loads(finished.stdout)
    assert finished.returncode == 0 and summary["equal"] and summary["max_abs_diff"] == 0 and summary["tensors"] > 0
    quiet = call_cli("diff", out / "resume.pth", out / "resume.pth", "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == ""
    target = tmp_path / "model.safetensors"
    exported = json.loads(call_cli("export", out / "resume.pth", "-o", target, "--data", kjv_folder, "--json").stdout)
    assert exported["bytes"] == target.stat().st_size and exported["format"] == "safetensors"


def test_lab_summary_reads_the_labs_json_files():
    assert sorted(FIGURE_NAMES) == sorted(FIGURES)  # the summary names them without loading matplotlib
    summary = lab_summary(ROOT / "docs" / "lab", shown=Path("runs/lab"))
    json.dumps(summary)  # --json prints it as is
    compare = json.loads((ROOT / "docs" / "lab" / "compare.json").read_text())
    text = "\n".join(render_lab(summary))
    assert text.startswith("resumed = straight: ") and "runs/lab/report.md" in text
    for name in ("noopt", "noskip"):
        run = compare["runs"][name]
        assert f"{number(run['max_abs_diff'])}  " in text and number(run["final_loss_diff"], signed=True) in text


def test_layout_aligns_labels_and_columns():
    assert aligned([("a", "1"), ("long", "2")]) == ["a     1", "long  2"]
    assert table(("run", "x"), [("resumed", "0"), ("noopt", "1.000e-02")]) == [
        "run              x",
        "resumed          0",
        "noopt    1.000e-02",
    ]


def test_the_continue_command_drops_the_stop_however_it_was_spelled():
    typed = ["train", "--out", "a b", "--stop-at=4", "--resume", "auto", "--sharded", "--steps", "8", "--stop-at", "3"]
    assert (
        continue_command(typed, Path("a b/resume.dcp"))
        == "exactresume train --out 'a b' --steps 8 --resume 'a b/resume.dcp'"
    )


def test_the_continue_command_keeps_the_sharding_mode():
    typed = ["train", "--shard", "fsdp", "--stop-at", "3", "--shard=fsdp"]
    assert continue_command(typed, Path("r")) == "exactresume train --shard fsdp --shard=fsdp --resume r"


def test_a_stopped_torchrun_rank_continues_under_torchrun_on_as_many_processes(stopped, kjv_folder, monkeypatch):
    from exactresume.config import TrainConfig
    from exactresume.summaries import train_summary
    from exactresume.training.job import TrainJob

    out, _ = stopped
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    job = TrainJob(TrainConfig(steps=8, batch=2, seq_len=16), kjv_folder, out, stop_at=4)
    for typed in (["train"], ["--", "train"]):  # as `torchrun -m exactresume -- train` hands it, or without
        words = shlex.split(train_summary(job, [*typed, "--out", str(out), "--stop-at", "4"])["continue"])
        assert words[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"], words
        assert words[4:] == ["-m", "exactresume", "--", "train", "--out", str(out), "--resume", str(out / "resume.pth")]
