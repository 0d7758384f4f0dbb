"""A user's own DataLoader or StatefulDataLoader, wrapped in a ResumableLoader part, resumes exactly.

Each kind of loader runs tests/loader_programs/loader_run.py: three epochs of 13 batches, a tiny model
with dropout and AdamW. A straight run is compared with one stopped mid-epoch (step 7), after an
epoch's last batch (13) and after the next epoch's first batch (14), each stop resumed in a new
process from a CheckpointStore: every step's samples and the final weights are torch.equal.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from exactresume import CheckpointError, CheckpointStore, ResumableLoader, UserError
from exactresume.errors import FieldError
from helpers import run_python

PROGRAM = Path(__file__).parent / "loader_programs" / "loader_run.py"
STOPS = (7, 13, 14)  # mid-epoch, an epoch's last batch, the next epoch's first: resumed three times
KINDS = {
    "shuffle": "shuffle=True, the global RNG",
    "generator": "shuffle=True, generator=, drop_last",
    "workers": "shuffle=True, num_workers=2",
    "persistent": "generator=, num_workers=2, persistent_workers",
    "distributed": "a DistributedSampler and its set_epoch",
    "per-sample": "batch_size=None",
    "stateful": "StatefulDataLoader, generator=, num_workers=2",
    "stateful-persistent": "StatefulDataLoader, generator=, num_workers=2, persistent_workers",
    "stateful-main": "StatefulDataLoader, generator=, num_workers=0",
    "stateful-global": "StatefulDataLoader, the global RNG",
    "iterable": "an IterableDataset, replayed",
    "augmented-seeded": "augmentation in persistent workers, seeded by the sample's index and the epoch",
}
LATER_STOPS = (20, 27)  # mid-epoch after the first epoch, and the third epoch's first batch


def finished_run(folder: Path, kind: str, stops: tuple[int, ...] = (), *options: object, last=()) -> dict:
    """Run the program with `options`, stopped at each of `stops` in turn, then to its end (with `last`
    options added): what it wrote, and under "printed" what each run printed."""
    printed = []
    for stop in [*stops, None]:
        more = ["--stop", stop] if stop else last
        finished = run_python(PROGRAM, folder, kind, *options, *more)
        assert finished.returncode == 0, finished.stdout
        printed.append(finished.stdout)
    return torch.load(folder / "out.pt") | {"printed": printed}


def first_difference(straight: dict, resumed: dict) -> str | None:
    """'step 8' for the first step whose samples differ, 'the weights' when only they do, else None."""
    assert len(straight["steps"]) == len(resumed["steps"]) == 39
    for step, (a, b) in enumerate(zip(straight["steps"], resumed["steps"]), start=1):
        if not torch.equal(a, b):
            return f"step {step}"
    same = all(torch.equal(straight["weights"][name], resumed["weights"][name]) for name in straight["weights"])
    return None if same else "the weights"


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """Each kind's straight run, made once for the module when first asked for."""
    made: dict[tuple[str, bool], dict] = {}

    def straight(kind: str, bare: bool = False, *options: object) -> dict:
        key = (kind, bare, *options)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"straight-{kind}")
            made[key] = finished_run(folder, kind, (), *(["--bare"] if bare else []), *options)
        return made[key]

    return straight


@pytest.mark.parametrize("kind", KINDS)
def test_resumed_at_each_stop_equals_straight(kind, straight_runs, tmp_path):
    resumed = finished_run(tmp_path, kind, STOPS)
    assert first_difference(straight_runs(kind), resumed) is None, KINDS[kind]


@pytest.mark.parametrize("kind", ["persistent", "stateful-persistent", "augmented-seeded"])
def test_persistent_workers_resumed_after_the_first_epoch(kind, straight_runs, tmp_path):
    """A persistent worker iterator opens its sampler once an epoch after the first, a new one twice:
    torchdata's sampler, which draws its order as it is opened, is opened again from the saved state."""
    resumed = finished_run(tmp_path, kind, LATER_STOPS)
    assert first_difference(straight_runs(kind), resumed) is None, KINDS[kind]
    assert not any("exactresume:" in printed for printed in resumed["printed"])


# (kind, workers saved with, workers resumed with, what the resumed run says: None when it is exact).
# A DataLoader's order does not depend on the worker count; torchdata's sampler draws its order each time
# it is opened, and a loader opens it once an epoch in its own process, twice through workers, so from 0
# to some or back it changes from the next epoch; persistent workers draw their base seed once per process,
# from the generator the order is drawn from too, and other loaders once per epoch.
WORKER_CHANGES = [
    ("generator", 2, 0, None),
    ("generator", 2, 1, None),
    ("generator", 0, 2, None),
    ("stateful", 2, 1, None),
    ("stateful", 2, 0, "its RandomSampler draws a new order each time the loader opens it"),
    ("stateful", 0, 2, "its RandomSampler draws a new order each time the loader opens it"),
    ("persistent", 2, 1, None),
    ("persistent", 2, 0, "it draws its workers' base seed from the generator its order is drawn from"),
]


@pytest.mark.parametrize(("kind", "saved", "resumed", "why"), WORKER_CHANGES)
def test_another_worker_count_is_exact_or_said(kind, saved, resumed, why, straight_runs, tmp_path):
    run = finished_run(tmp_path, kind, (20,), "--workers", saved, last=("--workers", resumed))
    said = [line for line in run["printed"][-1].splitlines() if "num_workers" in line]
    assert (first_difference(straight_runs(kind, False, "--workers", saved), run) is None) is (why is None)
    if why is None:
        assert said == []
    else:
        persistent = ", persistent_workers=True" if kind == "persistent" else ""
        setup = f"num_workers={saved}{persistent if saved else ''}"
        assert len(said) == 1 and said[0].startswith(f"exactresume: the {build_name(kind)} was saved with {setup} ")
        assert f"now has num_workers={resumed}{persistent if resumed else ''}: {why}" in said[0]
        assert said[0].endswith(f"; resume with {setup} to be exact")


def build_name(kind: str) -> str:
    return ("StatefulDataLoader" if kind.startswith("stateful") else "DataLoader") + " over Numbered"


def test_augmentation_drawn_in_workers_is_said_at_the_first_save(straight_runs, tmp_path):
    """Noise drawn from a worker's own RNG: a run resumed mid-epoch differs, and each run's first save says why."""
    run = finished_run(tmp_path, "augmented", (20,))
    assert first_difference(straight_runs("augmented"), run) is not None
    said = [line for line in run["printed"][0].splitlines() if line.startswith("exactresume:")]
    assert len(said) == 1 and "DataLoader over Augmented draws random numbers in its workers" in said[0], said


def test_a_workers_numpy_draw_is_seen_between_its_key_refills():
    """numpy's MT19937 refills its 624 keys only every 624 words: a draw in between moves the position alone."""
    import numpy as np

    from exactresume.loaders.worker_draws import _moved, _rng_states

    np.random.seed(0)
    np.random.normal(size=8)  # the refill after seeding
    before = _rng_states()
    np.random.normal(size=8)
    assert _moved(before, _rng_states())
    assert not _moved(_rng_states(), _rng_states())


@pytest.mark.parametrize("loader", ["generator", "persistent"])
def test_a_save_between_epochs_keeps_the_generators(tmp_path, loader):
    """Saved after an epoch's `for` ended, with a generator the script makes anew: the next epochs' order is
    the straight run's, not the first epoch's again. With persistent workers and the global RNG: the resumed
    run's first iterator draws a base seed the straight run's kept iterator did not, before the order."""
    program = PROGRAM.parent / "between_epochs.py"
    for role in ("straight", "resumed"):
        assert run_python(program, tmp_path, role, loader).returncode == 0
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert len(straight) == len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_killed_at_random_moments_with_saves_every_step(straight_runs, tmp_path):
    """SIGKILL at random moments (during saves too), each run resuming the last; then a run to the end."""
    chooser = random.Random(37)  # six steps, in order, each run resuming the one before; a few ms into each
    moments = [(step, chooser.uniform(0, 0.01)) for step in sorted(chooser.sample(range(3, 36), 6))]
    codes = [run_python(PROGRAM, tmp_path, "shuffle", "--every-step", "--kill-at", *moment) for moment in moments]
    assert all(ended.returncode in (0, -9) for ended in codes), [ended.stdout for ended in codes]
    assert sum(ended.returncode == -9 for ended in codes) >= 3, "too few runs were killed to test anything"
    resumed = finished_run(tmp_path, "shuffle", (), "--every-step")
    assert first_difference(straight_runs("shuffle"), resumed) is None


@pytest.mark.parametrize(
    ("kind", "stop", "parts_at"),
    [
        ("generator", 7, "step 8"),  # GeneratorPart(g) over a DataLoader: the epoch's start, not the position
        ("stateful-main", 7, "step 14"),  # StatefulDataLoader(generator=g) as a part: right to the next epoch
        ("stateful-global", 7, "the weights"),  # without generator=: the batches, not the global RNG after them
    ],
)
def test_bare_loaders_part_where_the_docs_say(kind, stop, parts_at, straight_runs, tmp_path):
    """Why the wrapper exists: the same loaders saved as users save them without it are not exact."""
    resumed = finished_run(tmp_path, kind, (stop,), "--bare")
    assert first_difference(straight_runs(kind, bare=True), resumed) == parts_at


@pytest.mark.parametrize("kind", ["generator", "stateful-main", "stateful-global"])
def test_wrapping_changes_no_batch(kind, straight_runs):
    """A loop that starts using ResumableLoader draws the batches it drew before, and trains alike."""
    assert first_difference(straight_runs(kind, bare=True), straight_runs(kind)) is None


class Numbered(torch.utils.data.Dataset):
    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return torch.tensor([index], dtype=torch.float32)


def saved_after_three(loader: ResumableLoader) -> dict:
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("now", "changed"),
    [
        (DataLoader(Numbered(24), batch_size=2, shuffle=True), "its dataset_length is 24, 26 when saved"),
        (DataLoader(Numbered(26), batch_size=2, shuffle=False), "its sampler is 'SequentialSampler in BatchSampler'"),
        (DataLoader(Numbered(26), batch_size=3, shuffle=True), "its batch_size is 3, 2 when saved"),
    ],
)
def test_a_changed_loader_is_refused_and_nothing_is_loaded(now, changed, tmp_path):
    model = torch.nn.Linear(1, 1)
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, {"model": model, "loader": ResumableLoader(DataLoader(Numbered(26), batch_size=2, shuffle=True))})
    store.close()
    other = torch.nn.Linear(1, 1)
    weights = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    with CheckpointStore(tmp_path, keep=1) as again:
        with pytest.raises(CheckpointError) as refused:
            again.load({"model": other, "loader": ResumableLoader(now)})
        assert changed in str(refused.value) and "\n" not in str(refused.value)
        assert "DataLoader over Numbered" in str(refused.value)
        assert all(torch.equal(weights[name], tensor) for name, tensor in other.state_dict().items())
        assert "(skip=['loader'] loads the other parts, this one left as it is)" in str(refused.value)  # the way out
        assert again.load({"model": other, "loader": ResumableLoader(now)}, skip=["loader"]) == 1


def test_a_state_not_a_resumable_loaders_is_refused():
    with pytest.raises(CheckpointError, match="is not a ResumableLoader's"):
        ResumableLoader(DataLoader(Numbered(4))).load_state_dict({"_num_yielded": 3})


def test_only_a_data_loader_is_wrapped():
    with pytest.raises(UserError, match="takes a torch DataLoader, got a list"):
        ResumableLoader([1, 2, 3])


class CursorSampler(Sampler):
    """A sampler of a user's own whose order comes from python's random: nothing the part restores."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(random.sample(range(self.length), self.length))


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (torch.tensor([index]) for index in range(6))


@pytest.mark.parametrize(
    ("loader", "said"),
    [
        (DataLoader(Numbered(6), batch_size=2, sampler=CursorSampler(6)), "draws its order from CursorSampler"),
        (DataLoader(Counting(), batch_size=2), "reads an IterableDataset"),
    ],
)
def test_a_loader_that_cannot_resume_exactly_says_so_once(loader, said, capsys):
    part = ResumableLoader(loader)
    for _ in range(3):
        state = saved_after_three(part) if said.startswith("draws") else part.state_dict()
    ResumableLoader(loader).load_state_dict(state)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("exactresume: the DataLoader over") for line in lines), lines
    assert said in lines[0]


def test_a_torch_sampler_says_nothing(capsys):
    part = ResumableLoader(DataLoader(Numbered(26), batch_size=2, shuffle=True))
    part.load_state_dict(saved_after_three(part))
    assert capsys.readouterr().err == ""


class Augmented(torch.utils.data.Dataset):
    """Sample i plus a random draw made in the worker that reads it (random augmentation)."""

    def __len__(self) -> int:
        return 26

    def __getitem__(self, index: int):
        return torch.tensor([float(index)]) + torch.rand(1)


def test_augmentation_in_workers_repeats_from_an_epoch_start_only():
    """What docs/loaders.md says of random draws inside workers: the same after a resume at an epoch's
    start (the workers get the same seeds), not mid-epoch (a worker's RNG has moved with what it read)."""
    make = lambda: ResumableLoader(DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=2))
    torch.manual_seed(0)
    straight, seen, saved = make(), [], {}
    while straight.epoch < 2:
        for batch in straight:
            seen.append(batch)
            if len(seen) in (7, 13):
                saved[len(seen)] = straight.state_dict(), torch.get_rng_state()
    for stop, repeats in ((7, False), (13, True)):
        resumed = make()
        resumed.load_state_dict(saved[stop][0])
        torch.set_rng_state(saved[stop][1])
        again = [batch for _ in range(2 - resumed.epoch) for batch in resumed]
        assert all(torch.equal(a.floor(), b.floor()) for a, b in zip(seen[stop:], again, strict=True))  # the order
        assert all(torch.equal(a, b) for a, b in zip(seen[stop:], again)) is repeats


def test_a_part_of_the_other_kind_or_wrapped_twice_is_named_as_that():
    loader = ResumableLoader(DataLoader(list(range(6)), batch_size=2))
    with pytest.raises(FieldError, match="already wrapped: wrap it once"):
        ResumableLoader(loader)
    with pytest.raises(CheckpointError, match="is a ResumableStream's, not a ResumableLoader's"):
        loader.load_state_dict({"kind": "hf_stream", "epoch": 0, "consumed": 1})
