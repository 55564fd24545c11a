"""``grpo-stream bench producer``: the producer's costs, measured in one run on this machine.

0. The headline: publish start -> new version in use from the learner's state dict, fs and kafka stream, the
   old way (a temporary file handed to the store) beside the direct one (:mod:`grpo_stream.bench.publish`).
1. Generation throughput (completions/s, tokens/s) of the ``hf`` and ``vllm`` backends on the tiny model and on
   the ~50M-parameter model: one warm-up ``generate`` call, then one timed call of ``gen_prompts`` prompts x
   ``group_size`` samples x up to ``max_tokens`` tokens (EOS may end a sample early; the actual tokens are
   counted). Also printed: the vLLM engine start time and the in-memory part of a swap, ``load_weights`` of the
   model's own ``model.safetensors`` into the running backend.
2. Weight swap latency, announcement -> new version in use, for the ``fs`` and ``kafka`` weight stores at
   10 MB, 100 MB and 1 GB (:mod:`grpo_stream.bench.swap`, which says how).

Targets: swap latency < 1 s per GB of weights (fetch + verify; the load into the engine comes on top).
Generation throughput has no fixed target: it is the baseline the vLLM backend must beat.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np

from grpo_core.config import KafkaConfig
from grpo_producers.backends.base import Backend, BackendConfig, SamplingConfig, make_backend
from grpo_stream.bench import publish, temporary_broker
from grpo_stream.bench.swap import fresh_topics, measure_swaps
from grpo_stream.tiny_model import build_tiny_model

MODELS = Path(".cache") / "bench-models"
PROMPT_LEN = 16


# ------------------------------------------------------------------------------------------ generation


def timed_generate(backend: Backend, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[float, int, int]:
    """One warm-up call, then one timed call: ``(seconds, completions, tokens)``."""
    sampling = SamplingConfig(max_tokens=max_tokens, seed=0)
    backend.generate(prompts[:2], n, sampling)
    t0 = time.perf_counter()
    out = backend.generate(prompts, n, sampling)
    dt = time.perf_counter() - t0
    completions = sum(len(samples) for samples in out)
    tokens = sum(len(s.token_ids) for samples in out for s in samples)
    return dt, completions, tokens


def measure_generation(preset: str, kind: str, gen_prompts: int, group_size: int, max_tokens: int) -> None:
    """Start one backend, time generation and an in-place weight reload, print one line, close it."""
    model_dir = build_tiny_model(MODELS / preset, preset=preset)
    cfg = BackendConfig(model=str(model_dir), kind=kind)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, PROMPT_LEN).tolist() for _ in range(gen_prompts)]
    t0 = time.perf_counter()
    backend = make_backend(cfg)
    start_s = time.perf_counter() - t0
    try:
        dt, completions, tokens = timed_generate(backend, prompts, group_size, max_tokens)
        t0 = time.perf_counter()
        backend.load_weights(model_dir)
        load_ms = 1000 * (time.perf_counter() - t0)
    finally:
        backend.close()
        del backend
        gc.collect()
    size_mb = (model_dir / "model.safetensors").stat().st_size / 1e6
    extra = f"  engine start {start_s:5.1f}s (memory share {cfg.memory_utilization():.2f})" if kind == "vllm" else ""
    print(f"  {preset:>5} {kind:>4}: {completions:4d} completions, {tokens:5d} tokens in {dt:6.2f}s = "
          f"{completions / dt:7.1f} completions/s, {tokens / dt:8.1f} tokens/s  "
          f"load_weights({size_mb:.0f} MB) {load_ms:7.1f} ms{extra}", flush=True)


def measure_publish(bootstrap: str | None, size_mb: int) -> None:
    """The headline: publish start -> in use from the learner's state dict (``grpo_stream.bench.publish``)."""
    with temporary_broker(bootstrap) as addr:
        kafka = KafkaConfig(bootstrap=addr)
        publish.report(kafka, fresh_topics(kafka), size_mb)


def main(bootstrap: str | None = None, sizes_mb: list[int] | None = None, gen_prompts: int = 16,
         group_size: int = 8, max_tokens: int = 32) -> int:
    sizes_mb = [10, 100, 1000] if sizes_mb is None else sizes_mb
    t_start = time.perf_counter()
    measure_publish(bootstrap, max(sizes_mb))
    print(f"generation: {gen_prompts} prompts of {PROMPT_LEN} tokens x {group_size} samples x up to {max_tokens} "
          f"tokens (one warm-up call first):", flush=True)
    for preset in ("tiny", "50m"):
        for kind in ("hf", "vllm"):
            measure_generation(preset, kind, gen_prompts, group_size, max_tokens)
    measure_swaps(bootstrap, sizes_mb)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
