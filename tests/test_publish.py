"""The learner's weights serialised straight into the store (``grpo_learner.publish``): the same file
``save_pretrained`` writes, in content (names, tied weights once, dtypes, metadata) and as a loadable model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

from grpo_core.config import KafkaConfig
from grpo_core.weights import MODEL_FILE, FsStoreConfig, Payload, WeightPublisher, WeightStoreConfig
from grpo_core.weights.payload import open_source
from grpo_learner import checkpoint
from grpo_learner.publish import config_payload, metadata_payloads, safetensors_payload
from grpo_stream.tiny_model import build_tiny_model


def payload_bytes(p: Payload) -> bytes:
    f, size = open_source(p)
    with f:
        data = f.read()
    assert len(data) == size
    return data


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def model(tiny: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stream_is_the_file_save_pretrained_writes(model: torch.nn.Module, dtype: torch.dtype,
                                                       tmp_path: Path) -> None:
    m = model.to(dtype)
    m.save_pretrained(tmp_path, safe_serialization=True)
    theirs = tmp_path / MODEL_FILE
    ours = payload_bytes(safetensors_payload(m))
    mine = load_safetensors(ours)
    with safe_open(str(theirs), "pt") as f:
        assert set(mine) == set(f.keys()) and "lm_head.weight" not in mine  # tied: stored once, as HF does
        assert f.metadata() == {"format": "pt"}
        for name in f.keys():  # noqa: SIM118 -- safe_open is not a mapping
            assert torch.equal(mine[name], f.get_tensor(name)) and mine[name].dtype == dtype


def test_published_through_the_store_it_loads_as_the_model(model: torch.nn.Module, tmp_path: Path) -> None:
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # weights that differ from the saved model
    cfg = WeightStoreConfig(fs=FsStoreConfig(root=str(tmp_path / "store")))
    pub = WeightPublisher(cfg, KafkaConfig(), "w", "wd", "run-p")
    payload = safetensors_payload(model)
    ann = pub.publish(7, {MODEL_FILE: payload, "config.json": config_payload(model)})
    path = tmp_path / "store" / ann.location
    assert ann.size_bytes == payload.size == path.stat().st_size
    assert ann.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = AutoModelForCausalLM.from_pretrained(path.parent)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_payload_that_does_not_match_its_size_is_refused() -> None:
    for blocks in ((b"abc",), (b"abcdef",)):
        f, _ = open_source(Payload(5, lambda b=blocks: b))
        with pytest.raises(OSError, match="announced 5"):
            f.read()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_model_directory_is_what_save_pretrained_writes(tiny: Path, dtype: torch.dtype,
                                                                      tmp_path: Path) -> None:
    """The learner checkpoints from the same payloads it publishes, with config.json and generation_config.json
    rendered once (``metadata_payloads``), not through ``save_pretrained`` at every publish: the directory must
    still be the one ``save_pretrained`` writes, file for file and byte for byte, and load as the model."""
    m = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)
    with torch.no_grad():
        next(m.parameters()).add_(0.25)
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    meta = metadata_payloads(m)
    path = checkpoint.save(tmp_path / "ck", 3, {"model": {MODEL_FILE: safetensors_payload(m), **meta}}, {}, {})
    ours, theirs = path / "model", tmp_path / "hf"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for f in theirs.iterdir():
        assert (ours / f.name).read_bytes() == f.read_bytes(), f.name
    loaded = AutoModelForCausalLM.from_pretrained(ours, dtype=dtype)
    for (name, a), b in zip(m.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Rendered once, read at every checkpoint and publish: a payload of bytes reads the same each time.
    assert payload_bytes(meta["config.json"]) == payload_bytes(meta["config.json"]) == (theirs / "config.json"
                                                                                         ).read_bytes()


@pytest.mark.parametrize("produced", [b"12345", b"1234567"])
def test_a_payload_of_another_size_than_announced_is_never_checkpointed(produced: bytes, tmp_path: Path) -> None:
    wrong = Payload(6, lambda: (produced[:3], produced[3:]))
    with pytest.raises(OSError, match=f"payload produced {len(produced)} bytes, announced 6"):
        checkpoint.save(tmp_path / "ck", 1, {"model": {MODEL_FILE: wrong}}, {}, {})
    assert checkpoint.load_latest(tmp_path / "ck") is None
