"""The continuous vLLM engine (``AsyncLLM``): groups finish out of order, aborts, and in-flight weight swaps
whose version spans are checked token by token against an HF float32 recompute with each version's weights.

Across a swap a request in flight either keeps its KV cache (``kv="keep"``, the default) or has its prefix
recomputed with the new weights (``kv="recompute"``: vLLM's ``clear_cache``). Tokens before the boundary match
the old weights' recompute either way; after it they match the new weights' recompute exactly when recomputed,
and, when the old KV was kept, a recompute in which the new weights attend over the cache the old ones wrote.
The boundaries and labels are vLLM's own weight-version spans (the swap labels the paused engine).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_backends import LOGPROB_TOL, PROMPTS, LogRecords, check_samples, weights_only_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_producers.backends import BackendConfig, SamplingConfig, make_backend
from grpo_producers.backends.base import KvOnSwap, Sample, StreamingBackend
from grpo_producers.backends.vllm_async import AsyncVLLMEngine, Finished
from grpo_stream.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
NEARBY_NOISE = 0.05


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("async-models")
    return build_tiny_model(root / "m0", seed=0), build_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def nearby(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights near v0's, as a learner step's are near the last version's: v0 plus noise of
    ``NEARBY_NOISE`` of each tensor's spread (unrelated random models would make a kept KV look like noise)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tensors = load_file(models[0] / "model.safetensors")
    out = tmp_path_factory.mktemp("nearby") / "model.safetensors"
    save_file({k: t + NEARBY_NOISE * t.float().std().nan_to_num() * torch.randn_like(t) for k, t in tensors.items()},
              out)
    shutil.copy(models[0] / "config.json", out.parent / "config.json")  # for the HF recompute
    return out.parent


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> Iterator[AsyncVLLMEngine]:
    pytest.importorskip("vllm")
    backend = make_backend(BackendConfig(kind="vllm", model=str(models[0])), streaming=True)
    assert isinstance(backend, AsyncVLLMEngine) and isinstance(backend, StreamingBackend)
    yield backend
    backend.close()


def recompute(model_dir: Path, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """log pi(token | prefix) of every completion token at T = 1, HF float32 (the learner's arithmetic)."""
    return recompute_kept([model_dir], [0], prompt, tokens)


def recompute_kept(weights: list[Path], starts: list[int], prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """:func:`recompute` as an engine that keeps the KV across swaps computes it: weights ``k`` take over at
    completion token ``starts[k]``, i.e. from the step whose *input* is the token before it, attending over the
    cache the earlier weights wrote for every position before."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt + tokens.tolist()])
    cuts = [0] + [len(prompt) + a - 1 for a in starts[1:]] + [ids.shape[1] - 1]
    cache, logits = DynamicCache(), []
    with torch.no_grad():
        for w, a, b in zip(weights, cuts, cuts[1:], strict=False):
            model = AutoModelForCausalLM.from_pretrained(w, dtype=torch.float32).eval()
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0])
    logp = torch.log_softmax(torch.cat(logits)[len(prompt) - 1:].float(), dim=-1)
    return logp.gather(1, torch.as_tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def wait_for(engine: AsyncVLLMEngine, timeout: float = 120.0) -> list[Finished]:
    out: list[Finished] = []
    deadline = time.monotonic() + timeout
    while engine.inflight() and time.monotonic() < deadline:
        out += engine.finished(0.2)
    return out + engine.finished(0.2)


def live_tokens(engine: AsyncVLLMEngine) -> int:
    """The fewest tokens any sample in flight has so far: the test peeks at vLLM's own per-request state (the
    engine delivers a group only once it is done)."""
    states = list(engine.engine.output_processor.request_states.values())
    return min((st.detokenizer.num_output_tokens() for st in states if st.detokenizer is not None), default=0)


def wait_tokens(engine: AsyncVLLMEngine, n: int) -> None:
    deadline = time.monotonic() + 60
    while live_tokens(engine) < n and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_completion_spanning_two_swaps_carries_each_version(engine: AsyncVLLMEngine, models: tuple[Path, Path],
                                                              nearby: Path, tmp_path: Path, kv: KvOnSwap) -> None:
    """v0 -> v1 (weights near v0's) -> v2 (v0's weights again): each span's logprobs are its own version's, so the
    boundaries are where the weights really changed and the labels are the versions'. Recomputed: exactly the
    recompute with that version's weights. Kept: exactly a recompute in which each version's weights attend over
    the cache the earlier versions wrote -- and not the plain recompute with its own weights.

    Kept-KV logprobs are not in general "much closer" to the own weights' plain recompute than to the older
    weights': with v1 = v0 + 5% noise they were about as far from both (mean |diff| 0.0129 vs 0.0128), as a
    two-layer model reading a 16-token prefix depends on that prefix's KV as much as on its other weights. What
    holds exactly is the kept-KV recompute, and the recorded logprob is the one each token was sampled with."""
    tok = AutoTokenizer.from_pretrained(models[0])
    prompt = tok.encode(PROMPTS[0])
    engine.submit("g0", prompt, 2, SamplingConfig(temperature=1.0, max_tokens=300), version=0, seed=11)
    wait_tokens(engine, 8)
    engine.swap(nearby, version=1, kv=kv)
    first = live_tokens(engine)
    wait_tokens(engine, first + 8)
    engine.swap(weights_only_dir(models[0], tmp_path / "v2"), version=2, kv=kv)
    split = engine.last_swap  # where the swap's time went (bench engine prints it)
    assert split.pause_s > 0 and split.reload_s > 0 and split.resume_s > 0
    [done] = wait_for(engine)
    assert done.key == "g0" and done.error is None and done.samples is not None
    spanned = [s for s in done.samples if len(s.spans) == 3]
    assert spanned, [s.spans for s in done.samples]  # both were in flight (300 tokens take seconds)
    weights = {0: models[0], 1: nearby, 2: models[0]}
    for s in spanned:
        assert [v for v, _ in s.spans] == [0, 1, 2] and s.spans[0][1] == 0
        bounds = [start for _, start in s.spans] + [len(s.token_ids)]
        assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False)), bounds
        recomputed = {v: recompute(weights[v], prompt, s.token_ids) for v in (0, 1)}
        kept = recompute_kept([weights[v] for v, _ in s.spans], bounds[:-1], prompt, s.token_ids)
        for (v, a), b in zip(s.spans, bounds[1:], strict=True):
            own = np.abs(s.logprobs[a:b] - recomputed[v % 2][a:b]).max()
            other = np.abs(s.logprobs[a:b] - recomputed[1 - v % 2][a:b]).max()
            mixed = np.abs(s.logprobs[a:b] - kept[a:b]).max()
            print(f"{kv} v{v} tokens [{a}, {b}): |lp - own| {own:.2e}, |lp - other| {other:.2e}, "
                  f"|lp - kept-KV recompute| {mixed:.2e}")
            assert other > 100 * LOGPROB_TOL  # really other weights
            if kv == "recompute" or v == 0:  # prefix recomputed with the new weights (v0: no older weights)
                assert own < LOGPROB_TOL
                assert v == 0 or mixed > 10 * LOGPROB_TOL  # the two modes really differ
            else:
                assert mixed < LOGPROB_TOL  # the new weights over the older weights' KV, exactly
                assert own > 10 * LOGPROB_TOL  # ... which really was kept, not recomputed
    engine.load_weights(models[0])


def test_a_request_after_a_swap_reuses_no_prefix_cached_with_older_weights(
        engine: AsyncVLLMEngine, models: tuple[Path, Path], tmp_path: Path) -> None:
    """A swap that keeps the KV keeps vLLM's prefix cache too: a later request with a cached prompt would
    attend over the old weights' KV while labelled the new version. The per-weights cache salt prevents it."""
    tok = AutoTokenizer.from_pretrained(models[0])
    block = int(engine.engine.vllm_config.cache_config.block_size)
    prompt = (tok.encode(PROMPTS[2]) * (2 * block))[:2 * block + 3]  # two full blocks: cacheable
    assert len(prompt) < engine.max_context() - 8
    sampling = SamplingConfig(temperature=1.0, max_tokens=4)
    engine.submit("cached", prompt, 2, sampling, version=0, seed=7)  # its prompt's blocks stay cached
    [done] = wait_for(engine)
    assert done.samples is not None
    engine.swap(weights_only_dir(models[1], tmp_path / "v9"), version=9, kv="keep")
    engine.submit("after", prompt, 2, sampling, version=9, seed=8)
    [done] = wait_for(engine)
    assert done.samples is not None
    for s in done.samples:
        assert s.spans == ((9, 0),)
        own = np.abs(s.logprobs - recompute(models[1], prompt, s.token_ids)).max()
        assert own < LOGPROB_TOL, own  # the prompt was computed with v9's weights, not taken from the cache
    engine.load_weights(models[0])


def test_a_sample_that_starts_after_a_swap_is_the_new_versions(engine: AsyncVLLMEngine,
                                                              models: tuple[Path, Path], tmp_path: Path) -> None:
    """The engine's label, not the version a group was submitted with, says which weights sampled: a group
    submitted as v5 whose first token comes after a swap to v6 is all v6."""
    tok = AutoTokenizer.from_pretrained(models[0])
    engine.swap(weights_only_dir(models[0], tmp_path / "v6"), version=6)
    engine.submit("late", tok.encode(PROMPTS[1]), 2, SamplingConfig(max_tokens=4), version=5, seed=4)
    [done] = wait_for(engine)
    assert done.samples is not None and all(s.spans == ((6, 0),) for s in done.samples)
    engine.load_weights(models[0])  # weights of no known version: the label goes with them
    engine.submit("after", tok.encode(PROMPTS[1]), 2, SamplingConfig(max_tokens=4), version=7, seed=5)
    [done] = wait_for(engine)
    assert done.samples is not None and all(s.spans == ((7, 0),) for s in done.samples)


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
    plain = SamplingConfig(max_tokens=12, seed=5)  # no stop string: the text is decoded here, not by vLLM
    check_samples(engine.generate(prompts, 3, plain), len(prompts), 3, plain, engine.vocab_size, tok.decode)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit("bad", [], 2, sampling, version=0)


def test_closing_the_engine_logs_no_error(engine: AsyncVLLMEngine) -> None:
    """The module's last test: it closes the shared engine. A clean stop used to log vLLM's "AsyncLLM
    output_handler failed" with an EngineDeadError traceback: ``AsyncLLM.shutdown`` stops the engine core while
    its output handler still waits on it. An operator reading a producer's log after every restart would take
    that for a crash. Whether the traceback is printed is a race, so the test checks its cause: the handler has
    ended before the core is stopped."""
    errors = LogRecords(logging.ERROR)
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(errors)
    llm = engine.engine
    core_shutdown = llm.engine_core.shutdown
    handler_done_at_core_shutdown: list[bool] = []

    def shutdown(*args: object, **kwargs: object) -> None:
        handler_done_at_core_shutdown.append(llm.output_handler.done())
        core_shutdown(*args, **kwargs)

    llm.engine_core.shutdown = shutdown
    try:
        engine.generate([[1, 2, 3]], 2, SamplingConfig(max_tokens=4, seed=0))  # the output handler is running
        assert not llm.output_handler.done()
        engine.close()
        engine.close()  # twice: the fixture's teardown closes it again
    finally:
        vllm_logger.removeHandler(errors)
    assert handler_done_at_core_shutdown == [True]
    assert llm.output_handler.cancelled()
    assert errors.messages == []
    assert not engine._thread.is_alive()
    # vLLM's shutdown cancels its client's socket tasks through the loop; a loop stopped before they have ended
    # leaves them pending, and their garbage collection logs asyncio's "Task was destroyed but it is pending!".
    assert [t.get_name() for t in asyncio.all_tasks(engine._loop)] == []
