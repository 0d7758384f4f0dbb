"""The one-file calls take an `s3://` object and a sharded folder as they take a path: `save_resume`
commits the object (nothing is written to a local folder named `s3:`), `read_resume` / `load_resume`
read it back, and `save_resume(..., sharded=True)` writes a DCP folder that `open_resume` restores."""

from __future__ import annotations

import pytest
import torch

from exactresume import GlobalRng, load_resume, open_resume, read_resume, save_resume

BUCKET = "one-file"


@pytest.fixture
def s3(moto_s3):
    """moto's S3 (conftest.moto_s3) with this module's bucket; its boto3 client."""
    moto_s3.create_bucket(Bucket=BUCKET)
    return moto_s3


def trained() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optim": optimizer, "rng": GlobalRng()}


def fresh() -> dict:
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1), "rng": GlobalRng()}


def assert_same(a: dict, b: dict) -> None:
    for name in ("model", "optim"):
        left, right = a[name].state_dict(), b[name].state_dict()
        if name == "optim":
            left, right = left["state"][0], right["state"][0]
        assert all(torch.equal(left[key], right[key]) for key in left), name


def test_save_resume_to_s3_commits_the_object_and_loads_back(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a path-minded writer would make a folder named "s3:"
    parts, target = trained(), f"s3://{BUCKET}/run/resume.pth"
    assert str(save_resume(target, parts, 7)) == target
    assert not (tmp_path / "s3:").exists()
    keys = {item["Key"] for item in s3.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert "run/resume.pth" in keys, keys
    assert read_resume(target)["checkpoint_step"] == 7
    loaded = fresh()
    assert load_resume(target, loaded) == 7
    assert_same(parts, loaded)


def test_save_resume_sharded_writes_a_folder_open_resume_restores(tmp_path):
    parts, folder = trained(), tmp_path / "resume.dcp"
    save_resume(folder, parts, 5, sharded=True)
    assert (folder / ".metadata").is_file()
    resumed = open_resume(folder)
    assert (resumed.kind, resumed.step) == ("sharded", 5)
    loaded = fresh()
    assert resumed.restore(loaded) == 5
    assert_same(parts, loaded)
