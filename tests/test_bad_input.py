"""Every user mistake: exit code 2, one line on stderr, no traceback, no good file overwritten."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
import torch

from helpers import SMALL, assert_one_line_error, call_cli, run_cli, train_cli


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, kjv_folder):
    """A small run stopped at step 3: a good resume file, and a weights file of the same run."""
    folder = tmp_path_factory.mktemp("stopped")
    train_cli(folder, "--data", kjv_folder, *SMALL, "--stop-at", 3, check=True)
    train_cli(folder, "--data", kjv_folder, *SMALL, "--overwrite", check=True)  # its log.csv over the stopped run's
    return folder


def fingerprint(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def resume_with(stopped, kjv_folder, out, resume_file, *flags):
    return call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--resume", resume_file, *flags)


def test_missing_resume_file(tmp_path, kjv_folder, stopped):
    assert_one_line_error(resume_with(stopped, kjv_folder, tmp_path, tmp_path / "nope.pth"), "nope.pth", "No such file")


def test_weights_file_is_not_a_resume_file(tmp_path, kjv_folder, stopped):
    finished = resume_with(stopped, kjv_folder, tmp_path, stopped / "final.pth")
    assert_one_line_error(finished, "final.pth", "weights file, not a resume file")


NO_SEAL = "no exactresume checksum at the end of the file (truncated, or not written by exactresume)"


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate_half", "damaged, truncated: the end of its zip archive is missing"),
        ("truncate_tail", "damaged, truncated: its last 10 bytes are missing"),
        ("flip_byte", "checksum mismatch, the file is damaged"),
        ("empty", "the file is empty (0 bytes)"),
        ("random", NO_SEAL),
    ],
)
def test_damaged_resume_file_is_refused(tmp_path, kjv_folder, stopped, damage, reason):
    good = (stopped / "resume.pth").read_bytes()
    broken = {
        "truncate_half": good[: len(good) // 2],
        "truncate_tail": good[:-10],
        "flip_byte": good[:1000] + bytes([good[1000] ^ 0x01]) + good[1001:],
        "empty": b"",
        "random": os.urandom(4096),
    }[damage]
    (tmp_path / "bad.pth").write_bytes(broken)
    finished = resume_with(stopped, kjv_folder, tmp_path / "out", tmp_path / "bad.pth")
    assert_one_line_error(finished, f"{tmp_path / 'bad.pth'}: {reason}")
    assert not (tmp_path / "out" / "final.pth").exists()


@pytest.mark.parametrize(
    "flag, value, field",
    [("--batch", 3, "batch"), ("--seq-len", 20, "seq_len"), ("--preset", "minimind-26m", "hidden_size")],
)
def test_resuming_a_different_run_names_the_fields(tmp_path, kjv_folder, stopped, flag, value, field):
    command = [
        "train",
        "--out",
        tmp_path,
        "--data",
        kjv_folder,
        *SMALL,
        flag,
        value,
        "--resume",
        stopped / "resume.pth",
    ]
    finished = call_cli(*command)
    assert_one_line_error(finished, "different run", field)
    assert "skip=" not in finished.stderr  # the library's way out, not the command line's
    way_out = {
        "batch": "(--allow-change batch lets the resume change it on purpose)",
        "seq_len": "--allow-change seq-len",
    }
    if field in way_out:
        assert way_out[field] in finished.stderr, finished.stderr
    else:  # a model shape: no flag lets it change
        assert "allow-change" not in finished.stderr, finished.stderr


def test_resuming_on_different_data_is_refused(tmp_path, stopped):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Paragraph {i} about stopping and resuming training runs exactly." * 3 for i in range(300))
    )
    assert call_cli("prepare", "--out", tmp_path / "data", "--corpus", corpus, "--vocab-size", 300).returncode == 0
    finished = call_cli(
        "train", "--out", tmp_path, "--data", tmp_path / "data", *SMALL, "--resume", stopped / "resume.pth"
    )
    assert_one_line_error(finished, "different run", "data")


def test_stop_at_not_before_steps(tmp_path, kjv_folder):
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--stop-at", 8)
    assert_one_line_error(finished, "--stop-at 8 must be between 1 and --steps - 1 (7)")
    finished = call_cli("lab", "--out", tmp_path, "--data", kjv_folder, "--steps", 10, "--stop-at", 12)
    assert_one_line_error(finished, "--stop-at 12 must be between 1 and --steps - 1 (9)")


def test_corpus_too_small_for_the_sequence_length(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n\n".join(f"a tiny corpus number {i}" for i in range(40)))
    assert call_cli("prepare", "--out", tmp_path / "data", "--corpus", corpus, "--vocab-size", 270).returncode == 0
    finished = call_cli("train", "--out", tmp_path / "out", "--data", tmp_path / "data", "--seq-len", 4096)
    assert_one_line_error(finished, "--seq-len 4096")


def test_unprepared_data_folder(tmp_path):
    finished = call_cli("train", "--out", tmp_path, "--data", tmp_path / "nothing")
    assert_one_line_error(finished, "not a prepared data folder (no manifest.json)", "exactresume prepare --out")


def test_data_that_is_a_file_or_a_folder_typed_wrong_is_refused_by_train_and_lab_alike(tmp_path, kjv_folder):
    """A file is not a data folder (no prepare could make one there), and a --data the lab is given must be
    prepared as train's must: only the lab's default folder is prepared where it is missing."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a corpus file, not a prepared folder\n")
    small = ["--steps", 8, "--stop-at", 4, "--preset", "tiny"]
    for command in (["train", "--out", tmp_path / "run"], ["lab", "--out", tmp_path / "lab", *small]):
        refused = call_cli(*command, "--data", corpus)
        assert_one_line_error(refused, f"{corpus} is a file, not a prepared data folder", "--corpus")
        refused = call_cli(*command, "--data", tmp_path / "typo")
        assert_one_line_error(refused, f"{tmp_path / 'typo'} is not a prepared data folder")
        refused = call_cli(*command[:-2], "--out", corpus, "--data", kjv_folder, *command[3:])
        assert_one_line_error(refused, f"output folder {corpus} is a file, not a folder")
        refused = call_cli(*command[:-2], "--out", kjv_folder, "--data", kjv_folder, *command[3:])
        assert_one_line_error(refused, f"--out {kjv_folder} is the --data folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt"]


def test_no_output_takes_a_checkpoints_place_and_no_run_writes_in_the_data_folder(tmp_path, kjv_folder, stopped):
    """A store takes the names of its checkpoints in its folder for its own (it writes, prunes and sets them
    aside), and the corpus's folder holds the corpus alone: each such place is refused before a step is
    trained, nothing written anywhere; a file of another name beside the checkpoints is the user's choice."""
    corpus, before = fingerprint(kjv_folder), fingerprint(stopped)
    out, local, folder = tmp_path / "run", tmp_path / "local", tmp_path / "c"
    tiers = ["--save-every", 1, "--local-checkpoints", local, "--durable-every", 2]
    checkpoint = stopped / "checkpoints" / "step-00000004.pth"
    named = "is named as a store names its checkpoints: give the file another name"
    data = f"is in the --data folder {kjv_folder}"
    for flags, said in (
        (["--weights", out / "checkpoints" / "step-00000003.pth"], named),
        (["--log", checkpoint, "--out", stopped], f"--log {checkpoint} {named}"),
        (["--weights", checkpoint, "--overwrite"], f"--weights {checkpoint} {named}"),  # another run's, whatever told
        (["--checkpoints", folder, "--samples", folder], f"--samples {folder} is the --checkpoints folder: give"),
        ([*tiers, "--weights", local / "step-00000002.pth.tmp"], named),
        ([*tiers, "--log", local / "step-00000002.dcp" / "log.csv"], named),
        (["--weights", kjv_folder / "w.pth"], f"--weights {kjv_folder / 'w.pth'} {data}: give the file another place"),
        (["--checkpoints", kjv_folder], f"--checkpoints {kjv_folder} {data}"),
        (
            [*tiers[:2], "--local-checkpoints", kjv_folder / "l", *tiers[4:]],
            f"--local-checkpoints {kjv_folder / 'l'} {data}",
        ),
        (["--out", kjv_folder / "run"], f"--out {kjv_folder / 'run'} {data}"),
    ):
        flags = flags if "--out" in flags else ["--out", out, *flags]
        assert_one_line_error(call_cli("train", "--data", kjv_folder, *SMALL, *flags), said)
    (tmp_path / "empty").mkdir()
    for told in ([], ["--overwrite"]):  # a folder is no weights file, empty or not, told or not
        refused = call_cli("train", "--out", out, "--data", kjv_folder, *SMALL, "--weights", tmp_path / "empty", *told)
        assert_one_line_error(refused, f"--weights {tmp_path / 'empty'} is not a torch file (it is a folder)")
    assert os.listdir(tmp_path) == ["empty"] and fingerprint(kjv_folder) == corpus and fingerprint(stopped) == before
    beside = call_cli(
        "train", "--out", folder, "--checkpoints", folder, "--data", kjv_folder, *SMALL, "--save-every", 4
    )
    assert beside.returncode == 0, beside.stderr  # OUT's own files beside its checkpoints: other names
    assert sorted(os.listdir(folder)) == ["final.pth", "log.csv", "step-00000004.pth", "step-00000008.pth"]
    again = call_cli("train", "--out", folder, "--checkpoints", folder, "--data", kjv_folder, *SMALL, "--save-every", 4)
    assert_one_line_error(
        again, "and save beside its checkpoints in", "--overwrite does not replace: continue that run"
    )


def test_output_folder_not_writable(tmp_path, kjv_folder):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    finished = call_cli("train", "--out", blocker / "out", "--data", kjv_folder, *SMALL)
    assert_one_line_error(finished, f"cannot create output folder {blocker / 'out'}: Not a directory")
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK | os.X_OK) or os.geteuid() == 0:
        # /sys is read-only even for root in a container; a real probe catches it where os.access would not.
        finished = call_cli("train", "--out", "/sys/exactresume-test", "--data", kjv_folder, *SMALL)
        assert_one_line_error(finished, "cannot create output folder /sys/exactresume-test")


def test_refusals_overwrite_nothing(tmp_path, kjv_folder, stopped):
    before = fingerprint(stopped)
    finished = resume_with(stopped, kjv_folder, stopped, stopped / "resume.pth", "--batch", 5)
    assert_one_line_error(finished, "different run", "train.batch 2 in file, 5 now")
    finished = resume_with(stopped, kjv_folder, stopped, stopped / "final.pth")  # final.pth is also --weights
    assert_one_line_error(finished, f"--weights would overwrite the resume file {stopped / 'final.pth'}")
    finished = resume_with(stopped, kjv_folder, stopped, stopped / "resume.pth", "--weights", stopped / "resume.pth")
    assert_one_line_error(finished, f"--weights would overwrite the resume file {stopped / 'resume.pth'}")
    assert fingerprint(stopped) == before


def test_a_fresh_run_overwrites_no_earlier_runs_outputs_unless_told(tmp_path, kjv_folder, stopped):
    before = fingerprint(stopped)
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--seed", 8)
    named = f"an earlier run's {stopped / 'final.pth'} and {stopped / 'log.csv'}: give another --out"
    assert_one_line_error(finished, named, "--overwrite to replace them")
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--stop-at", 3, "--log", "x.csv")
    assert_one_line_error(finished, f"an earlier run's {stopped / 'resume.pth'}:", "--overwrite to replace it")
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--resume", "auto")  # none there
    assert_one_line_error(finished, f"{stopped / 'final.pth'} and {stopped / 'log.csv'} are a finished run's, which")
    finished = call_cli(
        "train", "--out", stopped, "--data", kjv_folder, *SMALL, "--resume", "auto", "--weights", tmp_path / "w.pth"
    )
    assert_one_line_error(finished, f"and {stopped / 'log.csv'} is a finished run's, which starting at step 0")
    assert fingerprint(stopped) == before
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--resume", "auto", "--overwrite")
    assert_one_line_error(finished, "--overwrite is for a run that starts fresh")
    finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--samples", tmp_path / "log.csv")
    assert_one_line_error(finished, f"--log and --samples name the same file, {tmp_path / 'log.csv'}")
    assert os.listdir(tmp_path) == [] and fingerprint(stopped) == before
    corpus = fingerprint(kjv_folder)
    tokens = tmp_path / "val.npy"  # the corpus's token file, copied out of its folder (where no output may go)
    tokens.write_bytes((kjv_folder / "val.npy").read_bytes())
    for told in (["--overwrite"], ["--resume", stopped / "resume.pth"]):  # a file of another kind, whatever the flags
        finished = call_cli("train", "--out", tmp_path, "--data", kjv_folder, *SMALL, "--weights", tokens, *told)
        assert_one_line_error(finished, f"--weights {tokens} is not a torch file (it begins b")
    assert tokens.read_bytes() == (kjv_folder / "val.npy").read_bytes()
    tokens.unlink()
    (tmp_path / "link.csv").symlink_to(stopped / "log.csv")
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--samples", tmp_path / "link.csv")
    assert_one_line_error(finished, "--log and --samples name the same file")
    (tmp_path / "link.csv").unlink()
    os.link(stopped / "log.csv", tmp_path / "hard.csv")  # a hard link: one file under two names
    finished = call_cli("train", "--out", stopped, "--data", kjv_folder, *SMALL, "--samples", tmp_path / "hard.csv")
    assert_one_line_error(finished, "--log and --samples name the same file")
    (tmp_path / "hard.csv").unlink()
    finished = call_cli("train", "--out", tmp_path / "o", "--data", kjv_folder, *SMALL, "--weights", kjv_folder)
    assert_one_line_error(finished, f"--weights {kjv_folder} is in the --data folder")  # a folder, and the corpus's
    assert fingerprint(kjv_folder) == corpus and fingerprint(stopped) == before
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("final.pth", "log.csv"):
        (copy / name).write_bytes((stopped / name).read_bytes())
    replaced = train_cli(copy, "--data", kjv_folder, *SMALL, "--seed", 8, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert fingerprint(copy)["final.pth"] != before["final.pth"]  # another seed's weights, as asked


@pytest.mark.timeout(60)  # a reader that opened the pipe would wait for a writer for ever
def test_a_pipe_given_as_a_checkpoint_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "pipe.pth")
    for finished in (call_cli("inspect", tmp_path / "pipe.pth"), call_cli("diff", tmp_path / "pipe.pth", tmp_path)):
        assert_one_line_error(finished, f"{tmp_path / 'pipe.pth'} is neither a file nor a folder (a pipe or a device)")


def test_bad_flag_is_one_line(tmp_path):
    finished = call_cli("train", "--out", tmp_path, "--batch", "many")
    assert_one_line_error(finished, "argument --batch: invalid int value: 'many'")
    finished = call_cli("diff", tmp_path / "a.pth", tmp_path / "b.pth")
    assert_one_line_error(finished, f"cannot read {tmp_path / 'a.pth'}: No such file or directory")


@pytest.mark.parametrize(
    "command", [("inspect", ""), ("diff", "", "b.pth"), ("train", "--out", ""), ("export", "a.pth", "-o", "")]
)
def test_an_empty_path_is_refused_not_read_as_the_current_folder(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finished = call_cli(*command)
    assert_one_line_error(finished, "a path cannot be empty")
    assert list(tmp_path.iterdir()) == []


def test_pickle_payload_does_not_run(tmp_path, kjv_folder, stopped):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"format": "exactresume.resume", "payload": Payload()}, tmp_path / "evil.pth")
    finished = run_cli(
        "train", "--out", tmp_path / "out", "--data", kjv_folder, *SMALL, "--resume", tmp_path / "evil.pth"
    )
    assert_one_line_error(finished, f"{tmp_path / 'evil.pth'}: {NO_SEAL}")  # refused before unpickling
    assert not marker.exists()
    finished = run_cli("diff", tmp_path / "evil.pth", stopped / "final.pth")  # diff reads unsealed files too
    assert_one_line_error(finished, f"{tmp_path / 'evil.pth'}: not a loadable torch file")
    assert not marker.exists()


def test_torch_refusals_are_told_whole_naming_what_was_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"weights": torch.ones(2), "payload": Payload()}, tmp_path / "evil.pth")
    (tmp_path / "noise.pth").write_bytes(b"\x80" + random.Random(0).randbytes(4096))  # begins as a pickle does
    for path, refused in ((tmp_path / "evil.pth", "system"), (tmp_path / "noise.pth", "Unsupported operand")):
        for finished in (call_cli("inspect", path), call_cli("diff", path, path)):
            assert_one_line_error(finished, f"{path}: not a loadable torch file (", refused)
            assert "PyTorch 2.6" not in finished.stderr  # torch's advice about its default, not about the file
    (tmp_path / "notes.txt").write_text("step,loss\n1,2.5\n")  # not a torch file at all: said so, not torch's words
    for finished in (call_cli("inspect", tmp_path / "notes.txt"), call_cli("diff", tmp_path / "notes.txt", path)):
        assert_one_line_error(finished, "notes.txt: not a torch file: it begins b'step,los', not as torch.save's zip")


def test_prepare_refusals_are_one_line_with_exit_2(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{not json\n')
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "ok.txt").write_text("\n\n".join(f"Paragraph {i} about stopping and resuming." for i in range(50)))
    out = tmp_path / "out"
    for flags, reason in (
        (["--corpus", tmp_path / "bad.jsonl"], f"corpus {tmp_path / 'bad.jsonl'} line 3: not valid JSON"),
        (["--corpus", tmp_path / "absent.txt"], f"cannot read corpus {tmp_path / 'absent.txt'}: No such file"),
        (
            ["--corpus", tmp_path / "ok.txt", "--tokenizer", tmp_path / "tokenizer.json"],
            f"cannot load tokenizer {tmp_path / 'tokenizer.json'}",
        ),
        (["--corpus", tmp_path / "ok.txt", "--vocab-size", 100], "vocab size must be between 259 and 65536, got 100"),
    ):
        assert_one_line_error(call_cli("prepare", "--out", out, *flags), reason)
        assert not (out / "manifest.json").exists()


def test_resume_auto_beside_a_stop_at_file_says_which_flag_reads_it(tmp_path, kjv_folder, stopped):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "resume.pth").write_bytes((stopped / "resume.pth").read_bytes())
    finished = call_cli("train", "--out", tmp_path / "out", "--data", kjv_folder, *SMALL, "--resume", "auto")
    said = finished.stdout + finished.stderr
    assert finished.returncode == 0 and "starting at step 0" in said, said
    assert f"(the --stop-at file {tmp_path / 'out' / 'resume.pth'} is read by --resume FILE)" in said, said
