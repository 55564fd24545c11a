"""Producer generation backends: config, the shared stop rule, HF and (slow) real vLLM engines.

The central property: a backend's behaviour logprobs equal the learner's recomputation of the same tokens
(``grpo_learner.batching.collate`` + ``grpo_learner.logprobs.completion_logprobs``) -- measured and printed here.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpo_core import wire
from grpo_core.config import ConfigError, load_config
from grpo_learner.batching import collate
from grpo_learner.logprobs import completion_logprobs
from grpo_producers.backends import Backend, BackendConfig, Sample, SamplingConfig, make_backend
from grpo_producers.backends.base import check_request, stop_cut
from grpo_producers.backends.hf import HFBackend
from grpo_stream.tiny_model import build_tiny_model

EOS = 0  # the tiny tokenizer's <|endoftext|> (EOS and padding)
PROMPTS = ["12+7=", "max(3,8)=", "Q: What is 3*4?\nA:"]  # different token lengths (left padding is exercised)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models with different random weights (same architecture and tokenizer)."""
    root = tmp_path_factory.mktemp("backend-models")
    return build_tiny_model(root / "m0", seed=0), build_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def prompt_ids(models: tuple[Path, Path]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(models[0])
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in ids}) == len(ids)
    return ids


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> PreTrainedModel:
    """The learner's view of model 0 (float32, eval)."""
    return AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(models: tuple[Path, Path]) -> Iterator[HFBackend]:
    backend = make_backend(BackendConfig(model=str(models[0])))
    assert isinstance(backend, HFBackend)
    yield backend
    backend.close()


# ------------------------------------------------------------------------------------------ helpers


def learner_diff(model: PreTrainedModel, prompts: Sequence[Sequence[int]], result: list[list[Sample]],
                 temperature: float = 0.0) -> float:
    """Max |backend logprob - learner recomputation| over all completion tokens of ``result``; ``temperature``
    is what the producer records (``logprob_temperature``: 0 for raw logprobs)."""
    groups = []
    for p, (prompt, samples) in enumerate(zip(prompts, result, strict=True)):
        members = [wire.Completion(
            group_id=f"p{p}@e0r0", index=k, group_size=len(samples), prompt_id=f"p{p}", task="t",
            prompt_token_ids=np.asarray(prompt, np.int32), completion_token_ids=s.token_ids,
            behaviour_logprobs=s.logprobs, policy_version=0, producer_id="test", finish_reason=s.finish_reason,
            logprob_temperature=temperature) for k, s in enumerate(samples)]
        groups.append(wire.ScoredGroup(
            group_id=f"p{p}@e0r0", prompt_id=f"p{p}", task="t", policy_version=0, completions=members,
            rewards=[0.0] * len(members), reward_mean=0.0, reward_std=0.0, verifier_id="v", group_size=len(members)))
    batch = collate(groups, [[0.0] * len(g.completions) for g in groups], pad_id=EOS)
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch)
    return float(((recomputed - batch.behaviour_logprobs) * batch.completion_mask).abs().max().item())


def check_samples(result: list[list[Sample]], prompts: int, n: int, sampling: SamplingConfig, vocab: int,
                  decode: object) -> None:
    """Shapes, dtypes and the finish-reason rule every backend must keep."""
    assert len(result) == prompts and all(len(r) == n for r in result)
    for s in (s for r in result for s in r):
        assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert 1 <= len(s.token_ids) <= sampling.max_tokens and len(s.logprobs) == len(s.token_ids)
        assert s.token_ids.min() >= 0 and s.token_ids.max() < vocab
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
        assert EOS not in s.token_ids[:-1].tolist()  # nothing after an EOS
        ends_eos = int(s.token_ids[-1]) == EOS
        ends_stop = any(s.text.endswith(t) for t in sampling.stop)
        if s.finish_reason == "stop":
            assert ends_eos or ends_stop, s
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == sampling.max_tokens and not ends_eos, s
        if not ends_stop:  # the text of a stop-string sample may be cut inside its last token
            # vLLM's incremental detokenizer withholds a trailing incomplete UTF-8 sequence (U+FFFD in a decode).
            full = decode(s.token_ids.tolist(), skip_special_tokens=True)  # type: ignore[operator]
            assert s.text.rstrip("\ufffd") == full.rstrip("\ufffd")
        for t in sampling.stop:  # the first stop string ends the sample: none complete earlier
            assert t not in s.text or s.text.index(t) + len(t) == len(s.text)


def greedy(backend: Backend, prompts: list[list[int]], max_tokens: int = 10) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens and their logprobs. A random tiny model with tied embeddings mostly repeats the prompt's
    last token whatever its weights, so the logprobs are what tells two models apart."""
    result = backend.generate(prompts, 1, SamplingConfig(temperature=0.0, max_tokens=max_tokens))
    return [r[0].token_ids.tolist() for r in result], np.concatenate([r[0].logprobs for r in result])


def same_outputs(a: tuple[list[list[int]], np.ndarray], b: tuple[list[list[int]], np.ndarray]) -> bool:
    return a[0] == b[0] and a[1].shape == b[1].shape and bool(np.abs(a[1] - b[1]).max() < LOGPROB_TOL)


def sampled(backend: Backend, prompts: list[list[int]]) -> list[list[int]]:
    """Seeded samples: the same random numbers, so different weights give different tokens."""
    result = backend.generate(prompts, 2, SamplingConfig(max_tokens=10, seed=5))
    return [s.token_ids.tolist() for r in result for s in r]


def weights_only_dir(model: Path, dest: Path) -> Path:
    """A directory like the weight store's: model.safetensors and nothing else."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "model.safetensors", dest / "model.safetensors")
    return dest


# ------------------------------------------------------------------------------------------ config and rules


def test_configs_validate_and_load() -> None:
    cfg = load_config(BackendConfig, None, ["model=/m", "kind=vllm", "dtype=bfloat16"])
    assert (cfg.kind, cfg.model, cfg.dtype, cfg.max_batch_prompts) == ("vllm", "/m", "bfloat16", 64)
    assert cfg.memory_utilization() == 0.15 and cfg.memory_utilization(on_cpu=False) == 0.9
    assert BackendConfig(model="m", device="cuda:1").memory_utilization() == 0.9
    assert BackendConfig(model="m", gpu_memory_utilization=0.3).memory_utilization(on_cpu=True) == 0.3
    for bad in (["kind=jax"], ["model=/m", "gpu_memory_utilization=1.5"], ["model=/m", "device=tpu"], [],
                ["model=/m", "max_batch_prompts=0"]):
        with pytest.raises(ConfigError):
            load_config(BackendConfig, None, bad)
    SamplingConfig().validate()
    for bad_sampling in (SamplingConfig(temperature=-1), SamplingConfig(top_p=0), SamplingConfig(top_k=-1),
                         SamplingConfig(max_tokens=0), SamplingConfig(stop=[""]), SamplingConfig(seed=-2)):
        with pytest.raises(ConfigError):
            bad_sampling.validate()


def test_check_request_names_the_bad_prompt() -> None:
    ok = SamplingConfig(max_tokens=4)
    check_request([[1, 2], [3]], 2, ok, max_context=6, vocab_size=10)
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty"):
        check_request([[1], []], 1, ok, 6, 10)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 3 prompt tokens \+ max_tokens 4 exceed"):
        check_request([[1, 2, 3]], 1, ok, 6, 10)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids"):
        check_request([[10]], 1, ok, 6, 10)
    with pytest.raises(ValueError, match="n: must be"):
        check_request([[1]], 0, ok, 6, 10)


def test_stop_cut() -> None:
    text = {1: "a", 2: "b", 3: "+=", 4: "c", EOS: ""}

    def decode(ids: Sequence[int]) -> str:
        return "".join(text[i] for i in ids)

    assert stop_cut([1, 2, 4], [EOS], [], decode) == (3, "length", "abc")
    assert stop_cut([1, EOS, EOS, EOS], [EOS], [], decode) == (2, "stop", "a")  # EOS kept, padding dropped
    assert stop_cut([1, 3, 2, 3], [EOS], ["+"], decode) == (2, "stop", "a+")  # text cut inside token 3
    assert stop_cut([1, 3, 2], [EOS], ["b", "+="], decode) == (2, "stop", "a+=")  # earliest completion wins
    assert stop_cut([1, 2, 3], [EOS], ["ab"], decode) == (2, "stop", "ab")
    assert stop_cut([1, EOS, 3], [EOS], ["+"], decode) == (2, "stop", "a")  # EOS before the stop string
    assert stop_cut([1, 2, 1], [EOS], ["ba"], decode) == (3, "stop", "aba")
    assert stop_cut([2, 2], [EOS, 4], ["x"], decode) == (2, "length", "bb")
    assert stop_cut([2, 4, 2], [EOS, 4], [], decode) == (2, "stop", "b")  # any of several EOS ids


def test_vllm_detokenizes_only_for_stop_strings_and_reads_each_logprob_layout() -> None:
    """vLLM's per-token detokenization runs only where a stop string needs it (else one decode per sample), and
    the sampled tokens' logprobs come out alike from vLLM's flat layout and its dict per position."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from grpo_producers.backends.vllm import sampled_logprobs, sampling_params, text_decoder

    plain, stops = SamplingConfig(max_tokens=4), SamplingConfig(max_tokens=4, stop=["x"])
    assert not sampling_params(plain, 2, None).detokenize and sampling_params(stops, 2, None).detokenize
    assert sampling_params(plain, 2, None).flat_logprobs
    assert text_decoder(plain, str) is str and text_decoder(stops, str) is None
    want = np.asarray([-0.5, -1.25], np.float32)
    per_position = [{5: Logprob(-0.5, rank=1)}, {7: Logprob(-1.25, rank=2)}]
    ranked = [{5: Logprob(-0.5), 9: Logprob(-3.0)}, {2: Logprob(-0.1), 7: Logprob(-1.25)}]  # more than the sampled
    for layout in (per_position, ranked):
        flat = FlatLogprobs()
        flat.extend(layout)
        for logprobs in (layout, flat):
            got = sampled_logprobs([5, 7], logprobs)
            assert got.dtype == np.float32 and got.tolist() == want.tolist(), (layout, logprobs)
    for bad in (None, per_position[:1]):
        with pytest.raises(RuntimeError, match="no per-token logprobs"):
            sampled_logprobs([5, 7], bad)


def test_make_backend_table() -> None:
    assert Backend.__doc__ and isinstance(HFBackend.name, str)
    from grpo_producers.backends.base import BACKENDS

    assert set(BACKENDS) == {"hf", "vllm"}
    with pytest.raises(ConfigError):
        make_backend(BackendConfig(model=""))


# ------------------------------------------------------------------------------------------ HF backend


def test_hf_samples_match_learner_logprobs(hf: HFBackend, reference: PreTrainedModel,
                                           prompt_ids: list[list[int]]) -> None:
    assert isinstance(hf, Backend) and hf.max_context() == 512
    rng_before = torch.get_rng_state()
    plain = SamplingConfig(max_tokens=12)
    result = hf.generate(prompt_ids, 4, plain)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the backend samples with its own RNG stream
    check_samples(result, 3, 4, plain, hf.vocab_size, hf.tokenizer.decode)
    diff = learner_diff(reference, prompt_ids, result)
    # Stop strings (single characters, so many samples stop) and a larger run, which is sure to contain EOS.
    stops = SamplingConfig(max_tokens=12, stop=["e", "+"], top_k=50, temperature=0.8)
    stopped = hf.generate(prompt_ids, 4, stops)
    check_samples(stopped, 3, 4, stops, hf.vocab_size, hf.tokenizer.decode)
    assert any(s.finish_reason == "stop" for r in stopped for s in r)
    diff = max(diff, learner_diff(reference, prompt_ids, stopped))
    many = [prompt_ids[i % 3] + [5 + i] for i in range(8)]
    big = SamplingConfig(max_tokens=48, seed=123)
    long_run = hf.generate(many, 8, big)
    check_samples(long_run, 8, 8, big, hf.vocab_size, hf.tokenizer.decode)
    assert any(int(s.token_ids[-1]) == EOS and s.finish_reason == "stop" for r in long_run for s in r)
    diff = max(diff, learner_diff(reference, many, long_run))
    print(f"max |HF backend - learner| logprob diff: {diff:.3g}")
    assert diff < LOGPROB_TOL


def test_hf_greedy_and_seeds(hf: HFBackend, reference: PreTrainedModel, prompt_ids: list[list[int]]) -> None:
    zero = SamplingConfig(temperature=0.0, max_tokens=10)
    first, second = hf.generate(prompt_ids, 3, zero), hf.generate(prompt_ids, 3, zero)
    for a, b in zip(first, second, strict=True):
        assert all(np.array_equal(s.token_ids, a[0].token_ids) for s in a + b)
    # Greedy = argmax of the raw logits, one prompt at a time (no padding involved).
    for prompt, samples in zip(prompt_ids, first, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(10):
                ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert samples[0].token_ids.tolist() == ids[0, len(prompt):].tolist()
    seeded = SamplingConfig(max_tokens=10, seed=7)
    a, b = hf.generate(prompt_ids, 2, seeded), hf.generate(prompt_ids, 2, seeded)
    assert all(np.array_equal(x.token_ids, y.token_ids) for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra, rb, strict=True))
    c = hf.generate(prompt_ids, 2, SamplingConfig(max_tokens=10, seed=8))
    assert any(not np.array_equal(x.token_ids, y.token_ids) for ra, rc in zip(a, c, strict=True)
               for x, y in zip(ra, rc, strict=True))
    # Unseeded calls continue one stream: reproducible from BackendConfig.seed, different call to call.
    unseeded = SamplingConfig(max_tokens=10)
    assert hf.generate(prompt_ids, 2, unseeded)[0][0].token_ids.tolist() != \
        hf.generate(prompt_ids, 2, unseeded)[0][0].token_ids.tolist()


def test_hf_max_batch_prompts_chunks(models: tuple[Path, Path], prompt_ids: list[list[int]]) -> None:
    small = make_backend(BackendConfig(model=str(models[0]), max_batch_prompts=2))
    try:
        zero = SamplingConfig(temperature=0.0, max_tokens=6)
        chunked = small.generate(prompt_ids, 2, zero)
        one = [small.generate([p], 2, zero)[0] for p in prompt_ids]
        assert [[s.token_ids.tolist() for s in r] for r in chunked] == [[s.token_ids.tolist() for s in r] for r in one]
    finally:
        small.close()


def test_hf_load_weights_in_place(models: tuple[Path, Path], prompt_ids: list[list[int]], tmp_path: Path) -> None:
    backend = HFBackend(BackendConfig(model=str(models[0])))
    other = HFBackend(BackendConfig(model=str(models[1])))
    try:
        before, target = greedy(backend, prompt_ids), greedy(other, prompt_ids)
        samples_before, samples_target = sampled(backend, prompt_ids), sampled(other, prompt_ids)
        assert not same_outputs(before, target) and samples_before != samples_target
        model_id = id(backend.model)
        backend.load_weights(weights_only_dir(models[1], tmp_path / "v1"))
        assert id(backend.model) == model_id
        assert backend.model.lm_head.weight is backend.model.model.embed_tokens.weight  # still tied
        assert same_outputs(greedy(backend, prompt_ids), target)
        assert sampled(backend, prompt_ids) == samples_target
        for (name, p), q in zip(backend.model.named_parameters(), other.model.parameters(), strict=True):
            assert torch.equal(p, q), name
        backend.load_weights(models[0])  # a full model directory works too
        assert same_outputs(greedy(backend, prompt_ids), before)
        with pytest.raises(FileNotFoundError):
            backend.load_weights(tmp_path / "empty")
    finally:
        backend.close()
        other.close()


def test_hf_load_weights_rejects_other_architectures(models: tuple[Path, Path], tmp_path: Path) -> None:
    wide = build_tiny_model(tmp_path / "wide", hidden=256, heads=4)
    backend = HFBackend(BackendConfig(model=str(models[0])))
    try:
        with pytest.raises(RuntimeError, match="size mismatch"):
            backend.load_weights(wide)
    finally:
        backend.close()


def test_hf_logprobs_at_the_sampling_temperature(models: tuple[Path, Path], reference: PreTrainedModel,
                                                 prompt_ids: list[list[int]]) -> None:
    """pipeline.logprobs=sampling: the behaviour logprobs are of log_softmax(logits / T), the distribution the
    tokens were drawn from, and the learner, dividing its logits by the recorded T, gets ratio 1 on policy."""
    tempered = make_backend(BackendConfig(model=str(models[0]), logprobs="sampling"))
    sampling = SamplingConfig(max_tokens=12, temperature=0.7, seed=3)
    result = tempered.generate(prompt_ids, 4, sampling)
    assert learner_diff(reference, prompt_ids, result, temperature=0.7) < LOGPROB_TOL
    assert learner_diff(reference, prompt_ids, result) > 100 * LOGPROB_TOL  # not the raw distribution


# ------------------------------------------------------------------------------------------ vLLM backend


@pytest.fixture(scope="module")
def vllm_backend(models: tuple[Path, Path]) -> Iterator[Backend]:
    """One real engine for all vLLM tests (start-up is ~20 s on CPU)."""
    pytest.importorskip("vllm")
    start = time.perf_counter()
    backend = make_backend(BackendConfig(kind="vllm", model=str(models[0])))
    print(f"vLLM engine start: {time.perf_counter() - start:.1f} s")
    yield backend
    start = time.perf_counter()
    backend.close()
    print(f"vLLM engine close: {time.perf_counter() - start:.1f} s")


@pytest.mark.slow
def test_vllm_samples_match_learner_logprobs(vllm_backend: Backend, reference: PreTrainedModel,
                                             prompt_ids: list[list[int]]) -> None:
    assert vllm_backend.name == "vllm" and vllm_backend.max_context() == 512
    vocab = int(reference.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(reference.name_or_path)
    start = time.perf_counter()
    plain = SamplingConfig(max_tokens=12)
    result = vllm_backend.generate(prompt_ids, 4, plain)
    check_samples(result, 3, 4, plain, vocab, tok.decode)
    diff = learner_diff(reference, prompt_ids, result)
    stops = SamplingConfig(max_tokens=12, stop=["e", "+"], top_k=50, temperature=0.8)
    stopped = vllm_backend.generate(prompt_ids, 4, stops)
    check_samples(stopped, 3, 4, stops, vocab, tok.decode)
    assert any(s.finish_reason == "stop" for r in stopped for s in r)
    diff = max(diff, learner_diff(reference, prompt_ids, stopped))
    many = [prompt_ids[i % 3] + [5 + i] for i in range(8)]
    big = SamplingConfig(max_tokens=48)
    long_run = vllm_backend.generate(many, 8, big)
    check_samples(long_run, 8, 8, big, vocab, tok.decode)
    assert any(int(s.token_ids[-1]) == EOS and s.finish_reason == "stop" for r in long_run for s in r)
    diff = max(diff, learner_diff(reference, many, long_run))
    print(f"max |vLLM backend - learner| logprob diff: {diff:.3g} ({time.perf_counter() - start:.1f} s)")
    assert diff < LOGPROB_TOL


@pytest.mark.slow
def test_vllm_seeds_differ_per_prompt(vllm_backend: Backend, prompt_ids: list[list[int]]) -> None:
    same = [prompt_ids[0]] * 2
    seeded = SamplingConfig(max_tokens=10, seed=11)
    a, b = vllm_backend.generate(same, 3, seeded), vllm_backend.generate(same, 3, seeded)
    tokens = [[s.token_ids.tolist() for s in r] for r in a]
    assert tokens == [[s.token_ids.tolist() for s in r] for r in b]  # reproducible
    flat = [t for r in tokens for t in r]
    assert len({tuple(t) for t in flat}) == len(flat)  # but no two samples share random numbers


@pytest.mark.slow
def test_vllm_load_weights_without_restart(vllm_backend: Backend, models: tuple[Path, Path], hf: HFBackend,
                                           prompt_ids: list[list[int]], tmp_path: Path) -> None:
    other = HFBackend(BackendConfig(model=str(models[1])))
    try:
        before, target = greedy(vllm_backend, prompt_ids), greedy(other, prompt_ids)
        assert same_outputs(before, greedy(hf, prompt_ids)) and not same_outputs(before, target)
        samples_before = sampled(vllm_backend, prompt_ids)
        engine = vllm_backend.llm  # type: ignore[attr-defined]
        start = time.perf_counter()
        vllm_backend.load_weights(weights_only_dir(models[1], tmp_path / "v1"))
        print(f"vLLM weight reload: {1000 * (time.perf_counter() - start):.0f} ms")
        assert vllm_backend.llm is engine  # type: ignore[attr-defined]
        assert same_outputs(greedy(vllm_backend, prompt_ids), target)
        assert sampled(vllm_backend, prompt_ids) != samples_before
        vllm_backend.load_weights(models[0])
        assert same_outputs(greedy(vllm_backend, prompt_ids), before)
        assert sampled(vllm_backend, prompt_ids) == samples_before
    finally:
        other.close()


@pytest.mark.slow
def test_vllm_logprobs_at_the_sampling_temperature(vllm_backend: Backend, models: tuple[Path, Path],
                                                   reference: PreTrainedModel, prompt_ids: list[list[int]]) -> None:
    """vLLM's processed_logprobs (after the temperature, no truncation) == the learner's logits / T."""
    vllm_backend.close()  # one engine at a time on this machine; the module's engine is not used after this
    tempered = make_backend(BackendConfig(kind="vllm", model=str(models[0]), logprobs="sampling"))
    try:
        sampling = SamplingConfig(max_tokens=12, temperature=0.7, seed=3)
        result = tempered.generate(prompt_ids, 4, sampling)
        assert learner_diff(reference, prompt_ids, result, temperature=0.7) < LOGPROB_TOL
        assert learner_diff(reference, prompt_ids, result) > 100 * LOGPROB_TOL
    finally:
        tempered.close()


class LogRecords(logging.Handler):
    """The messages of the records a logger hands it (vLLM's loggers do not propagate to pytest's caplog)."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("tied", [True, False])
def test_a_reload_warns_only_of_layers_that_should_have_had_weights(tied: bool) -> None:
    """Every swap used to log "RotaryEmbedding: Failed to load weights" and, for a tied head, "ParallelLMHead:
    ...": two WARNING lines per swap in the producer's log, echoed to the terminal by the run supervisor. Here a
    worker's reload logs through vLLM's own logger what vLLM 0.32 logs for the tiny model, plus a layer that
    must still warn."""
    pytest.importorskip("vllm")
    import inspect
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.reload import layerwise

    from grpo_producers.backends.vllm import NOT_LOADED, RELOAD_LOGGER, ExpectedReloadWarnings, WeightReloadExtension

    # The filter keys on vLLM's logger and message: a vLLM that renames either fails here, not silently.
    assert layerwise.logger.name == RELOAD_LOGGER and f'"{NOT_LOADED}"' in inspect.getsource(layerwise)
    model = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=tied))

    class Worker(WeightReloadExtension):
        model_runner = SimpleNamespace(get_model=lambda: model)

        def reload_weights(self, weights_path: str) -> None:
            for layer in ("RotaryEmbedding", "ParallelLMHead", "QKVParallelLinear"):
                layerwise.logger.warning(NOT_LOADED, layer)

    seen = LogRecords()
    layerwise.logger.addHandler(seen)
    try:
        Worker().grpo_reload_weights("/unused")
        Worker().grpo_reload_weights("/unused")  # one filter per process, however many swaps
        assert sum(isinstance(f, ExpectedReloadWarnings) for f in layerwise.logger.filters) == 1
    finally:
        layerwise.logger.removeHandler(seen)
        for f in [f for f in layerwise.logger.filters if isinstance(f, ExpectedReloadWarnings)]:
            layerwise.logger.removeFilter(f)
    untied = [] if tied else ["ParallelLMHead: Failed to load weights"]
    assert seen.messages == 2 * [*untied, "QKVParallelLinear: Failed to load weights"]


def test_a_vllm_producer_shards_over_the_gpus_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """tensor_parallel_size reaches the engine, visible_devices its environment before it starts; pipeline stages
    and an hf backend asked to shard are refused with what to do instead."""
    pytest.importorskip("vllm")
    from grpo_producers.backends.vllm import engine_kwargs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # recorded, so the value engine_kwargs sets is undone after
    cfg = load_config(BackendConfig, None, ["model=/m", "kind=vllm", "tensor_parallel_size=2", "visible_devices=2,3"])
    kwargs = engine_kwargs(cfg)
    assert kwargs["tensor_parallel_size"] == 2 and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert engine_kwargs(load_config(BackendConfig, None, ["model=/m", "kind=vllm"]))["tensor_parallel_size"] == 1
    for bad, says in ((["kind=vllm", "pipeline_parallel_size=2"], "tensor_parallel_size instead"),
                      (["kind=hf", "tensor_parallel_size=2"], "vllm only"),
                      (["kind=vllm", "tensor_parallel_size=2", "visible_devices=0"], "list tensor_parallel_size"),
                      (["kind=vllm", "tensor_parallel_size=0"], ">= 1")):
        with pytest.raises(ConfigError, match=says):
            load_config(BackendConfig, None, ["model=/m", *bad])
