"""Checkpoint integrity without a broker: every checkpoint carries a sha256 manifest; a damaged, truncated or
incomplete one is never used silently; a full disk is one line naming the path, the space and the setting; the
leftovers of an interrupted save go at the next start."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_core.weights import MODEL_FILE, Payload
from grpo_learner import checkpoint
from grpo_learner.manifest import MANIFEST, verify
from grpo_learner.publish import tensors_payload


def _save(root: Path, step: int, scale: float = 1.0, keep: int = 3) -> Path:
    weights = {"w": torch.arange(4096, dtype=torch.float32) * scale}
    files = {MODEL_FILE: tensors_payload(weights), "config.json": Payload.of_bytes(b"{}")}
    state: dict[str, Any] = {"trainer": {"optimizer": {"m": torch.ones(2048)}}, "rng": checkpoint.rng_state()}
    return checkpoint.save(root, step, {"model": files}, state, {"offsets": {"0": step * 2}}, keep=keep)


def test_every_file_is_in_the_manifest_with_its_hash(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["meta.json", "model/config.json", "model/model.safetensors", "trainer.pt"]
    assert verify(path) == ""
    assert checkpoint.load_latest(tmp_path).step == 1


@pytest.mark.parametrize(("damage", "reason"), [
    ("overwrite", "model/model.safetensors does not match its sha256"),
    ("truncate", "trainer.pt has .* bytes, the manifest says"),
    ("delete", "model/config.json is missing"),
    ("manifest", "manifest.json is missing"),
    ("meta", "meta.json is missing"),
])
def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one(tmp_path: Path, damage: str,
                                                                   reason: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2, scale=2.0)
    if damage == "overwrite":
        with (newest / "model" / MODEL_FILE).open("r+b") as f:
            f.seek(1024)
            f.write(b"\xff" * 4096)
    elif damage == "truncate":
        data = (newest / "trainer.pt").read_bytes()
        (newest / "trainer.pt").write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        (newest / "model" / "config.json").unlink()
    else:
        (newest / (MANIFEST if damage == "manifest" else "meta.json")).unlink()
    rejected: list[tuple[str, str]] = []
    found = checkpoint.load_latest(tmp_path, on_reject=lambda p, why: rejected.append((p.name, why)))
    assert found is not None and found.step == 1 and found.meta["offsets"] == {"0": 2}
    assert len(rejected) == 1 and rejected[0][0] == "step-00000002"
    assert re.search(reason, rejected[0][1]), rejected
    assert newest.is_dir()  # a reader (audit, demo) leaves it where it is
    assert checkpoint.load_latest(tmp_path, repair=True).step == 1  # the learner moves it aside
    assert not newest.exists() and (tmp_path / "damaged-step-00000002").is_dir()


def test_none_intact_is_a_refusal_not_a_fresh_start(tmp_path: Path) -> None:
    only = _save(tmp_path, 1)
    (only / "trainer.pt").write_bytes(b"PK\x03\x04 half a zip")
    with pytest.raises(checkpoint.CheckpointError, match=r"no intact checkpoint in .*step-00000001: trainer.pt"):
        checkpoint.load_latest(tmp_path, repair=True)
    with pytest.raises(checkpoint.CheckpointError, match="damaged-step-00000001"):
        checkpoint.load_latest(tmp_path, repair=True)
    assert checkpoint.load_latest(tmp_path / "nothing-here") is None  # a fresh run is still a fresh run


def test_a_checkpoint_from_before_manifests_is_used_with_a_warning(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = _save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    del meta["integrity"]
    (path / "meta.json").write_text(json.dumps(meta))
    (path / MANIFEST).unlink()
    assert checkpoint.load_latest(tmp_path).step == 1
    assert "no integrity manifest" in caplog.text


def test_leftovers_of_an_interrupted_save_are_removed_at_start(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    leftover = checkpoint.temp_dir(tmp_path, 2)
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / MODEL_FILE).write_bytes(b"x" * 100)
    assert checkpoint.load_latest(tmp_path).step == 1 and leftover.exists()  # readers touch nothing
    assert checkpoint.load_latest(tmp_path, repair=True).step == 1
    assert not leftover.exists()


def test_a_full_disk_is_one_line_naming_path_space_and_setting(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    with pytest.raises(checkpoint.CheckpointError) as refused:
        _save(tmp_path, 2, keep=2)
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path) in message and "keep_checkpoints=2" in message
    assert "0.00 GB free" in message and "GB needed" in message
    assert not checkpoint.temp_dir(tmp_path, 2).exists() and checkpoint.load_latest(tmp_path).step == 1


def test_running_out_of_space_while_writing_leaves_nothing_behind(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1)

    def full(_f: object, _block: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_all", full)
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint step 2: no space left on {tmp_path}"):
        _save(tmp_path, 2)
    assert not checkpoint.temp_dir(tmp_path, 2).exists()
    assert checkpoint.load_latest(tmp_path).step == 1


def test_non_finite_names_the_tensor_and_the_count() -> None:
    t = torch.zeros(10)
    t[3], t[7] = float("nan"), float("inf")
    assert checkpoint.non_finite([("a", torch.ones(3)), ("b", t), ("ids", torch.arange(3))]) == "b: 2"
    assert checkpoint.non_finite([("a", torch.ones(3))]) == ""
