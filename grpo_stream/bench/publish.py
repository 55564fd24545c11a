"""What the pipeline waits for at a weight update: publish start -> new version in use, from the learner's live
state dict, for the ``fs`` store and the ``kafka`` store with the producers' chunk stream; the headline of
``grpo-stream bench producer``.

Two ways to publish, measured in the same run so the ratio is not the machine's mood:

- ``via file``: what the learner did before: save the state dict to a temporary safetensors file, then hand the
  file to the store (which copies or uploads it, hashing as it reads).
- ``direct``: the learner now: the state dict serialised straight into the store's file or chunk records, hashed
  as it is written (``grpo_learner.publish.safetensors_payload``).

The learner is a child process of its own (as deployed); this process plays the producer: it follows the
announcements and fetches + verifies the version (the in-memory load is part 1's ``load_weights``). Each way is
published ``keep + 2`` times and the last one reported: the steady state of a learner, where the fs store writes
over a retired version's file and the producers' stream has its spare file ready.
Target: < 2 s/GB publish start -> in use, for fs and the kafka stream.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from multiprocessing.connection import Connection

import torch

from grpo_core.config import KafkaConfig
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_consumer
from grpo_core.weights import (
    MODEL_FILE,
    FsStoreConfig,
    KafkaStoreConfig,
    WeightFetcher,
    WeightPublisher,
    WeightStoreConfig,
)
from grpo_core.weights.subscriber import WeightSubscriber
from grpo_stream.bench import swap

TARGET_S_PER_GB = 2.0
MODES = ("via file", "direct")
TENSOR_MB = 64


def random_model(size_mb: int) -> torch.nn.Module:
    """A module of float32 parameters adding up to ``size_mb`` MB (64 MB each), random like trained weights."""
    module = torch.nn.Module()
    left, k, gen = size_mb * 1_000_000 // 4, 0, torch.Generator().manual_seed(size_mb)
    while left > 0:
        n = min(left, TENSOR_MB * 1_000_000 // 4)
        module.register_parameter(f"p{k:03d}", torch.nn.Parameter(torch.randn(n, generator=gen)))
        left, k = left - n, k + 1
    return module


def _publish(publisher: WeightPublisher, version: int, model: torch.nn.Module, mode: str) -> None:
    from safetensors.torch import save_file

    from grpo_learner.publish import safetensors_payload, unique_tensors

    if mode == "direct":
        publisher.announce(publisher.publish(version, {MODEL_FILE: safetensors_payload(model)}))
        return
    with tempfile.TemporaryDirectory(prefix="grpo-weights-") as tmp:  # the old learner path
        save_file(unique_tensors(model), f"{tmp}/{MODEL_FILE}", metadata={"format": "pt"})
        publisher.announce(publisher.publish(version, {MODEL_FILE: f"{tmp}/{MODEL_FILE}"}))


def _learner(kafka: KafkaConfig, topics: PipelineContract, cfg: WeightStoreConfig, run: str, size_mb: int,
             conn: Connection) -> None:
    """The child: on each request (a mode), publish + announce its model as the next version."""
    publisher = WeightPublisher(cfg, kafka, topics.topic("weights"), topics.topic("weight_data"), run)
    model = random_model(size_mb)
    try:
        _ = publisher.producer  # connected before timing: a learner's publisher is long-lived
        conn.send("ready")
        version = 0
        while (mode := conn.recv()) is not None:
            version += 1
            with torch.no_grad():
                for p in model.parameters():  # a training step's worth of change: every byte differs
                    p.add_(1e-3)
            t0 = time.time()
            _publish(publisher, version, model, mode)
            conn.send(t0)
    finally:
        publisher.close()
        conn.close()


def measure(kind: str, kafka: KafkaConfig, topics: PipelineContract, size_mb: int) -> dict[str, float]:
    """Seconds publish start -> in use per mode (the second of two publications each)."""
    stream = kind == "kafka"
    root = swap.WEIGHTS / f"publish-{kind}"
    cfg = WeightStoreConfig(kind=kind, fs=FsStoreConfig(root=str(root / "store")),  # type: ignore[arg-type]
                            kafka=KafkaStoreConfig(cache_dir=str(root / "cache"), stream=stream))
    run = f"bench-publish-{kind}"
    fetcher = WeightFetcher(cfg, kafka, topics.topic("weight_data"), stream_run=run if stream else None)
    subscriber = WeightSubscriber(make_consumer(kafka, "bench-weights", None), topics.topic("weights"), run,
                                  fetcher, 0)
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=_learner, args=(kafka, topics, cfg, run, size_mb, child_end), daemon=True)
    child.start()
    child_end.close()
    out: dict[str, float] = {}
    try:
        swap._receive(conn)
        for mode in MODES:
            for _ in range(cfg.fs.keep + 2):  # the steady state: the fs store has a retired version to write over
                time.sleep(swap.GAP_S)  # the training steps between two publications
                conn.send(mode)
                swapped = swap._swap(subscriber)
                done = time.time()
                started = swap._receive(conn)
                out[mode] = done - started if swapped is not None else float("inf")  # type: ignore[operator]
        conn.send(None)
    finally:
        swap.close_bench(child, subscriber, fetcher, root)
    return out


def report(kafka: KafkaConfig, topics: PipelineContract, size_mb: int = 1000) -> None:
    print(f"HEADLINE publish start -> in use, the learner's {size_mb} MB state dict (fetch + verify; load in part 1), "
          f"target < {TARGET_S_PER_GB:.0f} s/GB:", flush=True)
    for kind in ("fs", "kafka"):
        t = measure(kind, kafka, topics, size_mb)
        gb = size_mb / 1000
        label = "fs" if kind == "fs" else "kafka stream"
        for mode in MODES:
            verdict = "OK" if t[mode] / gb < TARGET_S_PER_GB else "ABOVE"
            print(f"  {label:>12} {mode:>8}: {t[mode]:6.2f}s = {t[mode] / gb:5.2f} s/GB ({verdict})", flush=True)
        print(f"  {label:>12} direct / via file = {t['direct'] / t['via file']:.2f}", flush=True)
