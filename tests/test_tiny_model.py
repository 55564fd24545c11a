"""The locally built tiny model: loads with the Auto classes, tokenizer round-trips, vLLM-friendly layout, cache."""

from __future__ import annotations

import json
import random
import string
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_stream.tiny_model import BUILD_FILE, EOS_TOKEN, PRESETS, build_tiny_model, param_count

SAMPLES = ["12+7=19", "max(3,8)=8", "min(4, 9) = 4", "Q: What is 3*4?\nA: 12", "  two  spaces ", "", "a",
           string.printable]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_loads_with_auto_classes_and_has_the_vllm_layout(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM CPU refuses head_dim 16
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (128, 2, 1)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size <= 512
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())  # noqa: SIM118 (safe_open is not a Mapping)
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert next(model.parameters()).dtype == torch.float32
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["pad_token_id"] == cfg.eos_token_id


def test_tokenizer_round_trips_ascii(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) <= 512 and len(tok) <= AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    assert tok.eos_token == tok.pad_token == EOS_TOKEN
    rng = random.Random(0)
    randoms = ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for s in SAMPLES + randoms:
        ids = tok.encode(s)
        assert tok.eos_token_id not in ids  # no BOS/EOS added: prompts are raw text
        assert tok.decode(ids) == s
    # Digits are single tokens, so arithmetic answers tokenize digit by digit.
    assert tok.convert_ids_to_tokens(tok.encode("12+7=19")) == ["1", "2", "+", "7", "=", "1", "9"]


def test_tokenizer_file_and_auto_tokenizer_agree(model_dir: Path) -> None:
    """transformers 5 loads the directory as Qwen2Tokenizer (rebuilt pipeline); vLLM or a plain tokenizers
    user may read tokenizer.json instead: both must give the same ids."""
    from tokenizers import Tokenizer

    auto, raw = AutoTokenizer.from_pretrained(model_dir), Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(1)
    for _ in range(300):
        s = "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 30)))
        assert auto.encode(s) == raw.encode(s).ids


def test_second_build_is_a_noop_and_changed_params_rebuild(model_dir: Path) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    start = time.perf_counter()
    assert build_tiny_model(model_dir) == model_dir
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == mtimes
    other = model_dir.parent / "seed1"
    build_tiny_model(other, seed=1)
    assert json.loads((other / BUILD_FILE).read_text())["seed"] == 1
    a = AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight
    b = AutoModelForCausalLM.from_pretrained(other).model.embed_tokens.weight
    assert not torch.equal(a, b)
    assert not list(model_dir.parent.glob(".*build-*"))  # temporary build directories are cleaned up


def test_generate_works(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    enc = tok(["12+7=", "max(3,8)="], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, top_k=0, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and 1 <= out.shape[1] - enc.input_ids.shape[1] <= 5
    assert isinstance(tok.decode(out[0]), str)


def test_presets_and_overrides() -> None:
    assert set(PRESETS) >= {"tiny", "50m"}
    assert 0.2e6 < param_count("tiny") < 0.5e6
    assert 45e6 < param_count("50m") < 55e6
    assert 480e6 < param_count("qwen2.5-0.5b") < 510e6  # Qwen2.5-0.5B: 494M
    for p in PRESETS.values():
        assert p["hidden"] // p["heads"] == 64
    with pytest.raises(TypeError, match="unknown parameters"):
        param_count("tiny", hiden=64)
    with pytest.raises(ValueError, match="preset"):
        param_count("huge")
