"""Weight swap latency, announcement -> new version in use, for the ``fs`` and ``kafka`` weight stores: part 2 of
``grpo-stream bench producer``.

Laid out as deployed: the learner publishes from a process of its own (here a child process, so its Python work
does not share the producer's interpreter lock), and this process plays the producer, with the allocator tuning a
producer applies (:func:`~grpo_core.process.reuse_freed_memory`). For each size the learner publishes and
announces a file of random bytes as the next version; a :class:`~grpo_core.weights.subscriber.WeightSubscriber`
polls until it sees the announcement, fetches and verifies the file (``load`` is a no-op here: part 1 measures
the in-memory load). The kafka store is measured twice: downloading after the announcement, and with the
fetcher's :class:`~grpo_core.weights.ChunkStream` assembling the version while it is published
(``weights.kafka.stream``, the producers' default). Each size is published twice, ``GAP_S`` apart (standing in
for the training steps between two publications), and the second swap is reported: the steady state of a learner
publishing same-size versions, where the producer's stream has prepared a spare file of that size.

Target: < 1 s per GB (fetch + verify). Below about 1 GB a fixed latency of tens of milliseconds (the
announcement's trip through the broker, poll wake-ups) dominates the per-GB figure, so the verdict is given
from 1 GB up.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
import uuid
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

import numpy as np

from grpo_core.config import KafkaConfig
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import make_admin, make_consumer
from grpo_core.process import reuse_freed_memory
from grpo_core.topics import ensure_topics
from grpo_core.weights import (
    MODEL_FILE,
    FsStoreConfig,
    KafkaStoreConfig,
    WeightFetcher,
    WeightPublisher,
    WeightStoreConfig,
)
from grpo_core.weights.subscriber import Swap, WeightSubscriber
from grpo_stream.bench import temporary_broker

TARGET_S_PER_GB = 1.0
VERDICT_FROM_MB = 1000
WEIGHTS = Path(".cache") / "bench-weights"
WRITE_CHUNK = 64 * 1024 * 1024
CHILD_TIMEOUT_S = 300.0
GAP_S = 2.0


def random_file(path: Path, size: int) -> Path:
    """``size`` random bytes (incompressible, like float weights), written in chunks and synced: gigabytes of
    dirty pages still being written back would throttle every writer during the measurement."""
    rng = np.random.default_rng(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(WRITE_CHUNK, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return path


def fresh_topics(kafka: KafkaConfig) -> PipelineContract:
    """The default topic plan under a unique prefix, created on the broker."""
    contract = PipelineContract(run=f"bench-{uuid.uuid4().hex[:8]}")
    admin = make_admin(kafka)
    try:
        ensure_topics(admin, contract)
    finally:
        admin.close()
    return contract


def _learner(kafka: KafkaConfig, topics: PipelineContract, cfg: WeightStoreConfig, run: str, paths: list[str],
             conn: Connection) -> None:
    """The child process: each time the parent asks, publish + announce the next file as the next version and
    answer with the publish seconds."""
    publisher = WeightPublisher(cfg, kafka, topics.topic("weights"), topics.topic("weight_data"), run)
    try:
        _ = publisher.producer  # connect before timing: a learner's publisher is long-lived
        conn.send("ready")
        for version, path in enumerate(paths, start=1):
            conn.recv()
            t0 = time.perf_counter()
            ann = publisher.publish(version, {MODEL_FILE: path})
            publish_s = time.perf_counter() - t0
            publisher.announce(ann)
            conn.send((publish_s, ann.published_at, ann.size_bytes))
    finally:
        publisher.close()
        conn.close()


def _receive(conn: Connection) -> object:
    if not conn.poll(CHILD_TIMEOUT_S):
        raise TimeoutError(f"the publishing process did not answer within {CHILD_TIMEOUT_S:.0f}s")
    return conn.recv()  # EOFError if it died: its traceback is on stderr


def _swap(subscriber: WeightSubscriber) -> Swap | None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        subscriber.poll(timeout_ms=20)
        swap = subscriber.maybe_swap(lambda d, v: None)
        if swap is not None:
            return swap
    return None


def measure_store(kind: str, kafka: KafkaConfig, topics: PipelineContract, files: dict[int, Path],
                  stream: bool = False) -> None:
    """A learner process publishes each file as the next version; this process swaps to it. One line per size.
    ``stream``: the kafka fetcher assembles chunks while they are published (``weights.kafka.stream``)."""
    root = WEIGHTS / f"{kind}-store"
    cfg = WeightStoreConfig(kind=kind, fs=FsStoreConfig(root=str(root)),  # type: ignore[arg-type]
                            kafka=KafkaStoreConfig(cache_dir=str(WEIGHTS / f"{kind}-cache"), stream=stream))
    run, label = f"bench-{kind}-{'stream' if stream else 'download'}", f"{kind}{' stream' if stream else ''}"
    fetcher = WeightFetcher(cfg, kafka, topics.topic("weight_data"), stream_run=run if kind == "kafka" else None)
    subscriber = WeightSubscriber(make_consumer(kafka, "bench-weights", None), topics.topic("weights"), run,
                                  fetcher, 0)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, as a learner on its own machine would be
    conn, child_end = ctx.Pipe()
    sizes = sorted(files)
    paths = [str(files[s]) for s in sizes for _ in range(2)]
    learner = ctx.Process(target=_learner, args=(kafka, topics, cfg, run, paths, child_end), name="bench-learner",
                          daemon=True)
    learner.start()
    child_end.close()  # so that a dead child reads as EOF here
    try:
        _receive(conn)
        for size_mb in sizes:
            for measured in (False, True):
                time.sleep(GAP_S)
                hits = fetcher.stream.hits if fetcher.stream is not None else 0
                conn.send("publish")
                swap = _swap(subscriber)
                done = time.time()
                publish_s, published_at, size = cast(tuple[float, float, int], _receive(conn))
                if swap is None:
                    print(f"  {label:>12} {size_mb:5d} MB: no swap within {CHILD_TIMEOUT_S:.0f} s", flush=True)
                elif measured:
                    streamed = fetcher.stream is not None and fetcher.stream.hits > hits
                    print(_line(label, size_mb, publish_s, done - published_at, size, swap, streamed), flush=True)
    finally:
        close_bench(learner, subscriber, fetcher, root, WEIGHTS / f"{kind}-cache")


def close_bench(child: BaseProcess, subscriber: WeightSubscriber, fetcher: WeightFetcher, *dirs: Path) -> None:
    """End a measurement: the publishing child, the receiving side, the directories it wrote."""
    child.join(timeout=60)
    if child.is_alive():
        child.terminate()
    subscriber.consumer.close()
    fetcher.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _line(label: str, size_mb: int, publish_s: float, latency: float, size: int, swap: Swap, streamed: bool) -> str:
    per_gb = latency / (size / 1e9)
    if size_mb < VERDICT_FROM_MB:
        verdict = "fixed latency dominates"
    else:
        verdict = f"target < {TARGET_S_PER_GB:.0f} s/GB: {'OK' if per_gb < TARGET_S_PER_GB else 'ABOVE'}"
    how = " streamed" if streamed else ""
    return (f"  {label:>12} {size_mb:5d} MB: publish {publish_s:6.2f}s, then swap latency {latency:6.2f}s "
            f"(fetch+verify{how} {swap.load_s:6.2f}s) = {per_gb:5.2f} s/GB ({verdict}); "
            f"publish start -> in use {publish_s + latency:6.2f}s")


def measure_swaps(bootstrap: str | None, sizes_mb: list[int]) -> None:
    print(f"weight swap latency, announcement -> new version in use (fetch + verify; load not included), "
          f"sizes {sizes_mb} MB; the learner publishes from a process of its own:", flush=True)
    reuse_freed_memory()  # as a producer using the kafka store does at start
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
                admin.delete_topics([spec.name for spec in topics.topic_plan()])
            finally:
                admin.close()
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)
