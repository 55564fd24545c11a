"""``grpo-stream bench producer``: the producer's two costs, measured in one run on this machine.

1. Generation throughput (completions/s, tokens/s) of the ``hf`` and ``vllm`` backends on the tiny model and on
   the ~50M-parameter model: one warm-up ``generate`` call, then one timed call of ``gen_prompts`` prompts x
   ``group_size`` samples x up to ``max_tokens`` tokens (EOS may end a sample early; the actual tokens are
   counted). Also printed: the vLLM engine start time and the in-memory part of a swap, ``load_weights`` of the
   model's own ``model.safetensors`` into the running backend.
2. Weight swap latency, announcement -> new version in use, for the ``fs`` and ``kafka`` weight stores at
   10 MB, 100 MB and 1 GB of random bytes: the learner publishes and announces; a producer's
   :class:`~producers.weights.WeightSubscriber` polls until it sees the announcement, fetches and verifies the
   file (``load`` is a no-op here: the in-memory load is measured separately in part 1). The kafka store is
   measured twice: downloading after the announcement, and with the fetcher's ``ChunkStream`` assembling the
   version while it is published (``weights.stream``, the producers' default).

Targets: swap latency < 1 s per GB of weights (fetch + verify; the load into the engine comes on top).
Generation throughput has no fixed target: it is the baseline the vLLM backend must beat.
"""

from __future__ import annotations

import gc
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from grpo_stream.bench import temporary_broker
from grpo_stream.config import KafkaConfig, TopicsConfig
from grpo_stream.kafka_io import make_admin, make_consumer
from grpo_stream.tiny_model import build_tiny_model
from grpo_stream.topics import ensure_topics
from grpo_stream.weight_store import WeightFetcher, WeightPublisher, WeightStoreConfig
from producers.backends.base import Backend, BackendConfig, SamplingConfig, make_backend
from producers.weights import WeightSubscriber

TARGET_S_PER_GB = 1.0
REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / ".cache" / "bench-models"
WEIGHTS = REPO / ".cache" / "bench-weights"
PROMPT_LEN = 16
WRITE_CHUNK = 64 * 1024 * 1024


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


# ------------------------------------------------------------------------------------------ weight swap


def random_file(path: Path, size: int) -> Path:
    """``size`` random bytes (incompressible, like float weights), written in chunks."""
    rng = np.random.default_rng(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(WRITE_CHUNK, left)
            f.write(rng.bytes(n))
            left -= n
    return path


def fresh_topics(kafka: KafkaConfig) -> TopicsConfig:
    """The default topic plan under a unique prefix, created on the broker."""
    topics, prefix = TopicsConfig(), f"bench-{uuid.uuid4().hex[:8]}"
    for spec in topics.all():
        spec.name = f"{prefix}-{spec.name}"
    admin = make_admin(kafka)
    try:
        ensure_topics(admin, topics)
    finally:
        admin.close()
    return topics


def measure_store(kind: str, kafka: KafkaConfig, topics: TopicsConfig, files: dict[int, Path],
                  stream: bool = False) -> None:
    """Publish + announce each file as the next version; a subscriber swaps to it. One line per size.
    ``stream``: the kafka fetcher assembles chunks while they are published (``weights.stream``)."""
    root = WEIGHTS / f"{kind}-store"
    cfg = WeightStoreConfig(kind=kind, root=str(root))  # type: ignore[arg-type]
    run = f"bench-{kind}-{'stream' if stream else 'download'}"
    label = f"{kind}{' stream' if stream else ''}"
    publisher = WeightPublisher(cfg, kafka, topics, run)
    fetcher = WeightFetcher(cfg, kafka, cache_dir=WEIGHTS / f"{kind}-cache",
                            stream=(topics.weight_data.name, run) if stream else None)
    _ = publisher.producer  # connect before timing: a learner's publisher is long-lived
    subscriber = WeightSubscriber(make_consumer(kafka, "bench-weights", None), topics.weights.name, run, fetcher, 0)
    try:
        for version, (size_mb, path) in enumerate(sorted(files.items()), start=1):
            t0 = time.perf_counter()
            ann = publisher.publish(version, {"model.safetensors": path})
            publish_s = time.perf_counter() - t0
            publisher.announce(ann)
            swap = None
            deadline = time.monotonic() + 300
            while swap is None and time.monotonic() < deadline:
                subscriber.poll(timeout_ms=50)
                swap = subscriber.maybe_swap(lambda d: None)
            done = time.time()
            if swap is None:
                print(f"  {label:>12} {size_mb:5d} MB: no swap within 300 s")
                continue
            latency = done - ann.published_at
            per_gb = latency / (ann.size_bytes / 1e9)
            print(f"  {label:>12} {size_mb:5d} MB: publish {publish_s:6.2f}s, then swap latency {latency:6.2f}s "
                  f"(fetch+verify {swap.load_s:6.2f}s) = {per_gb:5.2f} s/GB (target < {TARGET_S_PER_GB:.0f} s/GB: "
                  f"{'OK' if per_gb < TARGET_S_PER_GB else 'ABOVE'}); publish start -> in use "
                  f"{publish_s + latency:6.2f}s", flush=True)
    finally:
        subscriber.consumer.close()
        fetcher.close()
        publisher.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(WEIGHTS / f"{kind}-cache", ignore_errors=True)


def measure_swaps(bootstrap: str | None, sizes_mb: list[int]) -> None:
    print(f"weight swap latency, announcement -> new version in use (fetch + verify; load not included), "
          f"sizes {sizes_mb} MB:", flush=True)
    files: dict[int, Path] = {}
    try:
        for mb in sizes_mb:
            files[mb] = random_file(WEIGHTS / f"random-{mb}MB.bin", mb * 1_000_000)
        with temporary_broker(bootstrap) as addr:
            kafka = KafkaConfig(bootstrap=addr)
            topics = fresh_topics(kafka)
            for kind, stream in (("fs", False), ("kafka", False), ("kafka", True)):
                measure_store(kind, kafka, topics, files, stream)
            admin = make_admin(kafka)
            try:
                admin.delete_topics([spec.name for spec in topics.all()])
            finally:
                admin.close()
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)


def main(bootstrap: str | None = None, sizes_mb: list[int] | None = None, gen_prompts: int = 16,
         group_size: int = 8, max_tokens: int = 32) -> int:
    sizes_mb = [10, 100, 1000] if sizes_mb is None else sizes_mb
    t_start = time.perf_counter()
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
