"""Drawn completion lengths (``sampling.lengths``): the stated distribution, and every backend honours it.

The vLLM checks run a real engine (both the batch engine and the continuous one); HF's run in-process."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from grpo_core.config import ConfigError, load_config
from grpo_producers.backends import BackendConfig, SamplingConfig, make_backend
from grpo_producers.backends.lengths import Z99, LengthDraws, LengthsConfig
from grpo_producers.config import ProducerConfig
from grpo_stream.tiny_model import build_tiny_model

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
LOGNORMAL = LengthsConfig(dist="lognormal", median=8, p99_ratio=4.0, seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lengths") / "m")


def test_lognormal_draws_have_the_stated_median_and_tail() -> None:
    cfg = LengthsConfig(dist="lognormal", median=64, p99_ratio=8.0)
    draws = np.asarray(cfg.draw(200_000, np.random.default_rng(0), cap=100_000))
    assert abs(np.median(draws) / 64 - 1) < 0.02
    assert abs(np.percentile(draws, 99) / (64 * 8) - 1) < 0.05
    assert math.isclose(cfg.sigma, math.log(8) / Z99)
    assert abs(draws.mean() / cfg.mean() - 1) < 0.02  # exp(mu + sigma^2 / 2), what sizing a benchmark uses


def test_draws_are_capped_fixed_and_reproducible() -> None:
    capped = LengthsConfig(dist="lognormal", median=64, p99_ratio=8.0).draw(10_000, np.random.default_rng(1), cap=100)
    assert max(capped) == 100 and min(capped) >= 1
    assert LengthsConfig(dist="fixed", median=7).draw(5, np.random.default_rng(0), cap=512) == [7] * 5
    a, b, other = LengthDraws(0), LengthDraws(0), LengthDraws(1)
    assert a(LOGNORMAL, 50, 64) == b(LOGNORMAL, 50, 64) != other(LOGNORMAL, 50, 64)
    with pytest.raises(ValueError, match="model has no drawn lengths"):
        LengthsConfig().draw(1, np.random.default_rng(0), cap=8)


def test_the_config_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ConfigError, match="median: must be >= 1"):
        load_config(ProducerConfig, None, ["backend.model=m", "sampling.lengths.dist=fixed",
                                           "sampling.lengths.median=0"])
    with pytest.raises(ConfigError, match="p99_ratio: must be >= 1"):
        load_config(ProducerConfig, None, ["backend.model=m", "sampling.lengths.p99_ratio=0.5"])
    with pytest.raises(ConfigError, match="ignore EOS and stop strings alike"):
        SamplingConfig(stop=["\n"], lengths=LengthsConfig(dist="fixed")).validate()
    assert load_config(ProducerConfig, None, ["backend.model=m", "sampling.lengths.dist=lognormal"]
                       ).sampling_params().lengths.dist == "lognormal"


def _check(result: list[list[object]], backend_seed: int, sampling: SamplingConfig) -> None:
    """Every sample exactly its drawn length (the backend's stream, in prompt-major order), cut for length."""
    expected = LengthDraws(backend_seed)(sampling.lengths, len(PROMPTS) * 4, int(sampling.max_tokens or 1))
    got = [len(s.token_ids) for group in result for s in group]  # type: ignore[attr-defined]
    assert got == expected
    assert len(set(got)) > 3  # lengths differ within and across groups
    assert {s.finish_reason for group in result for s in group} == {"length"}  # type: ignore[attr-defined]
    assert all(len(s.logprobs) == len(s.token_ids) for group in result for s in group)  # type: ignore[attr-defined]


def test_hf_samples_are_exactly_their_drawn_lengths(model: Path) -> None:
    backend = make_backend(BackendConfig(model=str(model), seed=5))
    sampling = SamplingConfig(temperature=1.0, max_tokens=40, lengths=LOGNORMAL)
    _check(backend.generate(PROMPTS, 4, sampling), 5, sampling)
    backend.close()


@pytest.fixture(scope="module")
def vllm_engines(model: Path) -> Iterator[tuple[object, object]]:
    pytest.importorskip("vllm")
    cfg = BackendConfig(kind="vllm", model=str(model), seed=5)
    batch, streaming = make_backend(cfg), make_backend(cfg, streaming=True)
    yield batch, streaming
    batch.close()
    streaming.close()


@pytest.mark.slow
def test_vllm_samples_are_exactly_their_drawn_lengths(vllm_engines: tuple[object, object]) -> None:
    """Both engines, and the continuous engine's group interface: one request per sample, EOS ignored."""
    batch, streaming = vllm_engines
    sampling = SamplingConfig(temperature=1.0, max_tokens=40, lengths=LOGNORMAL)
    _check(batch.generate(PROMPTS, 4, sampling), 5, sampling)  # type: ignore[attr-defined]
    _check(streaming.generate(PROMPTS, 4, sampling), 5, sampling)  # type: ignore[attr-defined]
    fresh = LengthDraws(5)
    fresh(sampling.lengths, len(PROMPTS) * 4, 40)  # the stream's next draws are the submitted group's
    want = fresh(sampling.lengths, 4, 40)
    streaming.submit("g", PROMPTS[0], 4, sampling, version=7, seed=1)  # type: ignore[attr-defined]
    deadline, done = time.monotonic() + 120, []
    while not done:
        assert time.monotonic() < deadline
        done = streaming.finished(1.0)  # type: ignore[attr-defined]
    samples = done[0].samples
    assert [len(s.token_ids) for s in samples] == want
    assert all(s.spans == ((7, 0),) for s in samples)
