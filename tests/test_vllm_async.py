"""The continuous vLLM engine (``AsyncLLM``): groups finish out of order, aborts, and in-flight weight swaps
whose version spans are checked token by token against an HF float32 recompute with each version's weights.

vLLM's pause clears the KV cache, so a request in flight at a swap has its prefix recomputed with the new
weights: tokens before the boundary match the old weights' recompute, tokens after it the new weights'.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_backends import LOGPROB_TOL, PROMPTS, check_samples, weights_only_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_producers.backends import BackendConfig, SamplingConfig, make_backend
from grpo_producers.backends.base import Sample, StreamingBackend
from grpo_producers.backends.vllm_async import AsyncVLLMEngine, Finished
from grpo_stream.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("async-models")
    return build_tiny_model(root / "m0", seed=0), build_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> Iterator[AsyncVLLMEngine]:
    pytest.importorskip("vllm")
    backend = make_backend(BackendConfig(kind="vllm", model=str(models[0])), streaming=True)
    assert isinstance(backend, AsyncVLLMEngine) and isinstance(backend, StreamingBackend)
    yield backend
    backend.close()


def recompute(model_dir: Path, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """log pi(token | prefix) of every completion token at T = 1, HF float32 (the learner's arithmetic)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def wait_for(engine: AsyncVLLMEngine, timeout: float = 120.0) -> list[Finished]:
    out: list[Finished] = []
    deadline = time.monotonic() + timeout
    while engine.inflight() and time.monotonic() < deadline:
        out += engine.finished(0.2)
    return out + engine.finished(0.2)


def live_tokens(engine: AsyncVLLMEngine) -> int:
    return min((len(r.tokens) for r in list(engine._live.values())), default=0)


def test_a_completion_spanning_a_swap_carries_both_versions(engine: AsyncVLLMEngine, models: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(models[0])
    prompt = tok.encode(PROMPTS[0])
    sampling = SamplingConfig(temperature=1.0, max_tokens=200)
    engine.submit("g0", prompt, 2, sampling, version=0, seed=11)
    deadline = time.monotonic() + 60
    while live_tokens(engine) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.swap(weights_only_dir(models[1], tmp_path / "v1"), version=1)
    [done] = wait_for(engine)
    assert done.key == "g0" and done.error is None and done.samples is not None
    spanned = [s for s in done.samples if len(s.spans) == 2]
    assert spanned, [s.spans for s in done.samples]  # both were in flight (200 tokens take seconds)
    for s in spanned:
        (v0, start0), (v1, boundary) = s.spans
        assert (v0, start0, v1) == (0, 0, 1) and 0 < boundary < len(s.token_ids)
        old, new = recompute(models[0], prompt, s.token_ids), recompute(models[1], prompt, s.token_ids)
        before = np.abs(s.logprobs[:boundary] - old[:boundary]).max()
        after = np.abs(s.logprobs[boundary:] - new[boundary:]).max()
        print(f"span at {boundary}/{len(s.token_ids)}: |lp - old| before {before:.2e}, |lp - new| after {after:.2e}")
        assert before < LOGPROB_TOL and after < LOGPROB_TOL  # KV recomputed with the new weights on resume
        assert np.abs(s.logprobs[boundary:] - old[boundary:]).max() > 100 * LOGPROB_TOL  # really another model
    engine.load_weights(models[0])


def test_groups_finish_in_their_own_order_and_aborted_ones_never_arrive(engine: AsyncVLLMEngine,
                                                                         models: tuple[Path, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models[0])
    prompt = tok.encode(PROMPTS[1])
    engine.submit("long", prompt, 2, SamplingConfig(max_tokens=150), version=3, seed=1)
    engine.submit("doomed", prompt, 2, SamplingConfig(max_tokens=150), version=3, seed=2)
    engine.submit("short", prompt, 2, SamplingConfig(max_tokens=2), version=3, seed=3)
    assert engine.inflight() == 3
    assert engine.abort("doomed") and not engine.abort("doomed")
    done = wait_for(engine)
    assert [d.key for d in done] == ["short", "long"]
    for d in done:
        assert d.samples is not None and all(s.spans == ((3, 0),) for s in d.samples)
    assert engine.inflight() == 0 and engine.finished(0.1) == []


def test_the_batch_interface_on_the_same_engine(engine: AsyncVLLMEngine, models: tuple[Path, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models[0])
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingConfig(max_tokens=12, stop=["7"], seed=5)
    result: list[list[Sample]] = engine.generate(prompts, 3, sampling)
    check_samples(result, len(prompts), 3, sampling, engine.vocab_size, tok.decode)
    again = engine.generate(prompts, 3, sampling)
    assert [[s.token_ids.tolist() for s in g] for g in result] == [[s.token_ids.tolist() for s in g] for g in again]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit("bad", [], 2, sampling, version=0)
