"""The producer's generation backends behind one small interface: prompts (token ids) in, samples out.

Two implementations: :class:`~grpo_producers.backends.hf.HFBackend` (``transformers.generate``; simple, starts in a
second, the choice for tests, the CPU demo and short runs) and :class:`~grpo_producers.backends.vllm.VLLMBackend`
(an in-process ``vllm.LLM`` engine; ~20 s to start on CPU, much faster per token afterwards, the production
choice). :func:`make_backend` builds either from a :class:`BackendConfig`; vLLM is imported only when asked for.

**Which logprobs a sample carries** (``BackendConfig.logprobs``, from the pipeline contract). ``sampling`` (the
default, as TRL and verl): ``Sample.logprobs[t]`` is ``log_softmax(logits / T)`` at the sampled token, in float32,
T the sampling temperature (the distribution the token was drawn from; vLLM's ``processed_logprobs``); the
producer records T on the completion and the learner divides its logits by it (``learner/logprobs.py``), so
on-policy samples have importance ratio 1 and a ratio != 1 measures staleness (plus kernel noise). ``raw``: T = 1
whatever the temperature (vLLM's ``raw_logprobs``), the objective of the raw policy. Greedy (T = 0) is raw in
both. Top-p / top-k with ``sampling`` is refused (``ProducerConfig``): vLLM's processed logprobs are then of the
renormalised nucleus, which the learner cannot recompute from its full softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from grpo_core.config import opt, require
from grpo_core.contract import LogprobMode
from grpo_producers.backends.lengths import LengthsConfig

FinishReason = Literal["stop", "length"]
BackendKind = Literal["hf", "vllm"]
Dtype = Literal["float32", "bfloat16", "float16"]

# Default share of memory vLLM may claim, per device type (BackendConfig.gpu_memory_utilization = None).
# On CUDA it is the GPU memory fraction for weights + activations + KV cache. On a CPU build vLLM reads the same
# flag as the fraction of *total RAM* its worker reserves (weights, activations and KV cache), and refuses to
# start when that much is not available -- so 0.9 would fail on any machine also running a learner. 0.15 of this
# machine's RAM (~2.2 GiB of 14.7 GiB on the NUMA node) leaves ~1.3 GiB of KV cache after ~0.9 GiB of worker
# overhead for the tiny model; much below that, the worker's own overhead exceeds the reservation.
DEFAULT_MEMORY_UTILIZATION = {"cuda": 0.9, "cpu": 0.15}


@dataclass
class SamplingConfig:
    """How to sample completions; the same meaning in every backend (vLLM's SamplingParams semantics)."""

    temperature: float = opt(1.0, "Sampling temperature; 0 = greedy (deterministic). Logprobs: pipeline.logprobs.")
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest token set with this much probability (1 = off).")
    top_k: int = opt(0, "Sample among the k most likely tokens only (0 = off).")
    max_tokens: int | None = opt(
        None, "Most completion tokens per sample (prompt + max_tokens must fit the context). null: the pipeline "
              "contract's max_new_tokens.")
    stop: list[str] = opt(help="Stop strings: a sample ends with the token that completes one of them "
                               "(its text ends with the stop string, finish_reason 'stop').", factory=list)
    seed: int | None = opt(None, "Seed for this call's sampling (reproducible batches); None: the backend's own "
                                 "RNG stream. Each prompt gets a distinct derived seed, never one shared seed.")
    lengths: LengthsConfig = opt(factory=LengthsConfig, help="Completion lengths: the model's (default), or drawn "
                                 "per sample with EOS ignored, for benchmarks (backends/lengths.py).")

    def validate(self) -> None:
        require(self.temperature >= 0, f"sampling.temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        require(0 < self.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, f"sampling.top_k: must be >= 0 (0 = off), got {self.top_k}")
        require(self.max_tokens is None or self.max_tokens >= 1,
                f"sampling.max_tokens: must be >= 1, got {self.max_tokens}")
        require(all(isinstance(s, str) and s for s in self.stop), "sampling.stop: stop strings must be non-empty")
        require(self.seed is None or self.seed >= 0, f"sampling.seed: must be >= 0 or null, got {self.seed}")
        self.lengths.validate()
        require(not (self.lengths.controlled and self.stop),
                "sampling.lengths: drawn lengths ignore EOS and stop strings alike; set sampling.stop: [] with them")


@dataclass
class Sample:
    """One completion of one prompt."""

    token_ids: np.ndarray  # int32 [T]: completion tokens, including the EOS token when it stopped on EOS
    logprobs: np.ndarray  # float32 [T]: raw log pi(token | prefix) at temperature 1 (see the module docstring)
    finish_reason: FinishReason  # "stop": EOS or a stop string; "length": max_tokens reached
    text: str  # decoded completion (special tokens such as EOS skipped); ends with the stop string if one hit
    # (version, first token index) of each policy version that sampled its tokens, oldest first, the first at
    # index 0 (in-flight weight updates; see vllm_async). Empty: one version, the caller's, for every token.
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # Cheap invariants every consumer relies on (the wire record checks the same lengths again).
        if self.token_ids.shape != self.logprobs.shape or self.token_ids.ndim != 1:
            raise ValueError(f"Sample: token_ids {self.token_ids.shape} and logprobs {self.logprobs.shape} "
                             "must be 1-d and of equal length")


@runtime_checkable
class Backend(Protocol):
    """What the producer loop needs from a generation engine."""

    name: str

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[list[Sample]]:
        """``n`` samples of each prompt: ``result[i]`` are the ``n`` samples of ``prompts[i]``."""
        ...

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place from a directory with ``*.safetensors`` (same architecture)."""
        ...

    def max_context(self) -> int:
        """The model's maximum positions: ``len(prompt) + sampling.max_tokens`` must not exceed it."""
        ...

    def close(self) -> None:
        """Release the engine (worker processes, memory). The backend is unusable afterwards."""
        ...


# What a request in flight keeps across an in-flight swap (weights.inflight_kv; backends/vllm_async.py).
KvOnSwap = Literal["keep", "recompute"]


@runtime_checkable
class StreamingBackend(Backend, Protocol):
    """A backend that also generates continuously (the producer's ``weights.swap: inflight`` loop): groups are
    submitted one at a time, come back as each finishes, and weights change under requests in flight."""

    def submit(self, key: str, prompt: list[int], n: int, sampling: SamplingConfig, version: int,
               seed: int | None = None) -> None: ...

    def finished(self, timeout: float) -> list[Any]: ...

    def abort(self, key: str) -> bool: ...

    def inflight(self) -> int: ...

    def capacity(self) -> int: ...

    def swap(self, model_dir: Path, version: int, kv: KvOnSwap = "keep") -> None: ...


@dataclass
class BackendConfig:
    """Which engine generates and how it holds the model."""

    model: str = opt(help="HF model id or local directory (config.json, *.safetensors, tokenizer files).")
    kind: BackendKind = opt("hf", "hf: transformers generate (quick start, tests, CPU demo); vllm: vLLM engine.")
    tokenizer: str | None = opt(None, "Tokenizer id or directory; None: the model's.")
    dtype: Dtype = opt("float32", "Weights/compute dtype (float32 on CPU; must match the learner's for ratio 1).")
    device: str = opt("cpu", "hf: cpu, cuda or cuda:N. vllm: picks the default gpu_memory_utilization (the "
                             "installed vLLM build decides where it runs).")
    gpu_memory_utilization: float | None = opt(
        None, "vllm: memory share for weights + KV cache. On GPU a fraction of GPU memory; on a CPU vLLM build the "
              "fraction of total RAM its worker reserves (start fails if not available). None: 0.9 on cuda, 0.15 "
              "on cpu (enough for the tiny model; raise it for bigger models / more concurrent sequences).")
    max_batch_prompts: int = opt(64, "hf: prompts per generate() call. HF keeps every step's raw logits, "
                                     "chunk x n x max_tokens x vocab floats: lower this for big vocabularies.")
    enforce_eager: bool = opt(True, "vllm: no CUDA graphs / torch.compile (quick start; turn off for throughput).")
    seed: int = opt(0, "Seed of the backend's own sampling RNG stream (vLLM engine seed; hf: private RNG state).")
    logprobs: LogprobMode = opt("raw", "Set by the producer from the pipeline contract's logprobs (sampling: "
                                       "log_softmax(logits / T); raw: T = 1); see this module's docstring.")
    tensor_parallel_size: int = opt(1, "vllm: GPUs one engine shards the model over (tensor parallel). Weight "
                                       "swaps reload every worker's shard (backends/vllm.py).")
    pipeline_parallel_size: int = opt(1, "vllm: pipeline stages; only 1 (the tied-head fix after a reload needs "
                                         "the embedding on the head's stage, which pipeline stages split).")
    visible_devices: str | None = opt(None, "vllm: the GPUs this producer's engine uses, e.g. '2,3' (set as "
                                            "CUDA_VISIBLE_DEVICES before it starts); as many as "
                                            "tensor_parallel_size. None: the process's own.")

    def validate(self) -> None:
        require(bool(self.model), "backend.model: required (a HF id or a local directory)")
        require(self.device == "cpu" or self.device.startswith("cuda"),
                f"backend.device: {self.device!r}: must be cpu, cuda or cuda:N")
        if self.gpu_memory_utilization is not None:
            require(0 < self.gpu_memory_utilization <= 1,
                    f"backend.gpu_memory_utilization: must be in (0, 1] or null, got {self.gpu_memory_utilization}")
        require(self.max_batch_prompts >= 1, f"backend.max_batch_prompts: must be >= 1, got {self.max_batch_prompts}")
        require(self.seed >= 0, f"backend.seed: must be >= 0, got {self.seed}")
        require(self.tensor_parallel_size >= 1,
                f"backend.tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        require(self.pipeline_parallel_size == 1,
                f"backend.pipeline_parallel_size: {self.pipeline_parallel_size}: only 1 is supported (pipeline "
                "stages split the embedding from the tied output head that a weight swap re-ties); shard with "
                "tensor_parallel_size instead")
        require(self.kind == "vllm" or (self.tensor_parallel_size == 1 and self.visible_devices is None),
                "backend.tensor_parallel_size / visible_devices: vllm only (hf: set device: cuda:N)")
        if self.visible_devices is not None:
            gpus = [g.strip() for g in self.visible_devices.split(",") if g.strip()]
            require(len(gpus) == self.tensor_parallel_size and all(g.isdigit() for g in gpus),
                    f"backend.visible_devices: {self.visible_devices!r}: list tensor_parallel_size "
                    f"({self.tensor_parallel_size}) GPU indices, e.g. '0,1'")

    def memory_utilization(self, on_cpu: bool | None = None) -> float:
        """The configured share, or the default for the device (``on_cpu`` overrides what ``device`` says)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        cpu = self.device == "cpu" if on_cpu is None else on_cpu
        return DEFAULT_MEMORY_UTILIZATION["cpu" if cpu else "cuda"]


def _make_hf(cfg: BackendConfig) -> Backend:
    from grpo_producers.backends.hf import HFBackend

    return HFBackend(cfg)


def _make_vllm(cfg: BackendConfig) -> Backend:
    from grpo_producers.backends.vllm import VLLMBackend  # imports vllm (seconds, and absent on some installs)

    return VLLMBackend(cfg)


def _make_vllm_async(cfg: BackendConfig) -> StreamingBackend:
    from grpo_producers.backends.vllm_async import AsyncVLLMEngine

    return AsyncVLLMEngine(cfg)


BACKENDS: dict[BackendKind, Callable[[BackendConfig], Backend]] = {"hf": _make_hf, "vllm": _make_vllm}
# Backends that can generate continuously (weights.swap: inflight); hf has only the batch path.
STREAMING: dict[BackendKind, Callable[[BackendConfig], StreamingBackend]] = {"vllm": _make_vllm_async}


def make_backend(cfg: BackendConfig, streaming: bool = False) -> Backend:
    """Validate ``cfg`` and build its backend (loads the model; vLLM also starts its engine processes);
    ``streaming``: the continuous engine (:data:`STREAMING`)."""
    cfg.validate()
    if streaming:
        require(cfg.kind in STREAMING, f"backend.kind={cfg.kind}: no continuous engine (weights.swap: inflight "
                                       f"needs one of {sorted(STREAMING)}); use weights.swap: between_batches")
        return STREAMING[cfg.kind](cfg)
    return BACKENDS[cfg.kind](cfg)


# ------------------------------------------------------------------------------------------ shared helpers


def check_request(prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, max_context: int,
                  vocab_size: int) -> None:
    """Refuse what no backend can serve, with the offending prompt's index (the caller dead-letters it).

    An empty prompt has no position to predict the first token from (the learner's collate refuses it too);
    an over-long one would exceed the position embeddings (HF silently extrapolates, vLLM errors).
    """
    sampling.validate()
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt")
        # max_tokens: resolved before a backend is called (ProducerConfig.sampling_params); None fails here
        if len(p) + sampling.max_tokens > max_context:  # type: ignore[operator]
            raise ValueError(f"prompts[{i}]: {len(p)} prompt tokens + max_tokens {sampling.max_tokens} exceed the "
                             f"model's context of {max_context}")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts[{i}]: token ids must be in [0, {vocab_size})")


def stop_cut(token_ids: Sequence[int], eos_ids: Iterable[int], stop: Sequence[str],
             decode: Callable[[Sequence[int]], str]) -> tuple[int, FinishReason, str]:
    """Where a generated token sequence really ends: ``(kept tokens, finish_reason, text)``.

    The sample ends at the first EOS (kept: the model chose to stop, and the learner must see that choice) or
    with the token that completes the first stop string, whichever comes first; else it ran to its length.
    Tokens after the end are padding or generation past a stop and are dropped. The text is cut right after
    the stop string even when the last kept token decodes to more (vLLM's ``include_stop_str_in_output``).
    ``decode`` must skip special tokens (EOS decodes to "").
    """
    eos = set(eos_ids)
    end = next((i + 1 for i, t in enumerate(token_ids) if t in eos), None)
    body = list(token_ids[:end - 1] if end is not None else token_ids)
    if stop:
        text = decode(body)
        if any(s in text for s in stop):
            # Smallest k whose text contains a stop string (containment only grows with k).
            lo, hi = 1, len(body)
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in decode(body[:mid]) for s in stop):
                    hi = mid
                else:
                    lo = mid + 1
            text = decode(body[:lo])
            cut = min(text.find(s) + len(s) for s in stop if s in text)
            return lo, "stop", text[:cut]
    if end is not None:
        return end, "stop", decode(body)
    return len(body), "length", decode(body)


def stop_lookback_tokens(stop: Sequence[str]) -> int:
    """Trailing tokens whose text surely contains a stop string that the newest token completed.

    Each token is at least one byte, so a stop string of b UTF-8 bytes spans at most b tokens; one more covers
    a character split at the window's start (it precedes the stop string, which starts on a character).
    """
    return max((len(s.encode()) for s in stop), default=0) + 1

