"""Weight store: fs and kafka round trips byte for byte, GC, corruption and loss detection, catching up on the
compacted announcements topic. The fs tests need no broker; the kafka ones use the session broker."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.producer.future import FutureRecordMetadata

from grpo_core import wire
from grpo_core.config import ConfigError, KafkaConfig, TopicsConfig, load_config
from grpo_core.kafka_io import make_admin, make_producer
from grpo_core.weights import (
    MODEL_FILE,
    FsStoreConfig,
    KafkaStoreConfig,
    Payload,
    WeightFetcher,
    WeightFetchError,
    WeightPublisher,
    WeightStoreConfig,
    chunks,
    latest_announcement,
    sha256_file,
)
from grpo_stream.bench import swap

MiB = 1 << 20


def _blob(path: Path, size: int, seed: int) -> bytes:
    """Random bytes: the store treats weights opaquely, and random data defeats any accidental compression."""
    data = np.random.default_rng(seed).bytes(size)
    path.write_bytes(data)
    return data


def _fs_cfg(tmp_path: Path, keep: int = 3, **kw: object) -> WeightStoreConfig:
    return WeightStoreConfig(fs=FsStoreConfig(root=str(tmp_path / "store"), keep=keep), fetch_retries=2,
                             fetch_backoff_s=0.01, **kw)


def _kafka_store(cache: Path, chunk: int = MiB, **kw: object) -> WeightStoreConfig:
    return WeightStoreConfig(kind="kafka", kafka=KafkaStoreConfig(chunk_bytes=chunk, cache_dir=str(cache)), **kw)


@dataclass
class Topics:
    """The two topics the weight store uses."""

    weights: str = "weights"
    weight_data: str = "weight-data"


def _pub(cfg: WeightStoreConfig, kafka: KafkaConfig, topics: Topics, run: str) -> WeightPublisher:
    return WeightPublisher(cfg, kafka, topics.weights, topics.weight_data, run)


def _fetcher(cfg: WeightStoreConfig, kafka: KafkaConfig, topics: Topics | None = None,
             stream_run: str | None = None) -> WeightFetcher:
    return WeightFetcher(cfg, kafka, (topics or Topics()).weight_data, stream_run=stream_run)


def _versions(run_dir: Path) -> list[str]:
    """Everything in a run's directory but the fs store's spare (a retired file kept to be written over)."""
    return sorted(p.name for p in run_dir.iterdir() if p.name != ".spare-model.safetensors")


@pytest.fixture
def topics(new_topic: Callable[..., str]) -> Topics:
    return Topics(new_topic("weights", 1, {"cleanup.policy": "compact"}),
                  new_topic("weight-data", 1, {"max.message.bytes": str(16 * MiB)}))


# ------------------------------------------------------------------------------------------ config


def test_config_validation_is_actionable() -> None:
    cfg = load_config(WeightStoreConfig, overrides=["kind=kafka", "kafka.chunk_bytes=1048576", "fs.keep=2"])
    assert (cfg.kind, cfg.kafka.chunk_bytes, cfg.fs.keep) == ("kafka", MiB, 2)
    with pytest.raises(ConfigError, match="weights.fs.keep"):
        load_config(WeightStoreConfig, overrides=["fs.keep=0"])
    with pytest.raises(ConfigError, match="weights.kafka.cache_keep"):
        load_config(WeightStoreConfig, overrides=["kafka.cache_keep=0"])
    with pytest.raises(ConfigError, match=r"weights.kafka.chunk_bytes.*kafka.max_record_bytes.*<= 16711680"):
        KafkaStoreConfig(chunk_bytes=16 * MiB).check_fits(KafkaConfig(), TopicsConfig().weight_data)
    with pytest.raises(ValueError, match="run name"):
        _pub(WeightStoreConfig(), KafkaConfig(), Topics(), "../etc")


# ------------------------------------------------------------------------------------------ fs store


def test_fs_round_trip_and_keep_gc(tmp_path: Path) -> None:
    cfg = _fs_cfg(tmp_path, keep=2)
    pub = _pub(cfg, KafkaConfig(), Topics(), "run-a")
    (tmp_path / "config.json").write_text('{"model_type": "toy"}')
    blobs, anns = [], []
    for v in (1, 2, 3):
        blobs.append(_blob(tmp_path / f"w{v}.bin", 3 * MiB + v, seed=v))
        anns.append(pub.publish(v, {MODEL_FILE: tmp_path / f"w{v}.bin", "config.json": tmp_path / "config.json"}))
    ann = anns[-1]
    assert (ann.store, ann.location, ann.size_bytes) == ("fs", f"run-a/v00000003/{MODEL_FILE}", 3 * MiB + 3)
    assert ann.sha256 == sha256_file(tmp_path / "w3.bin")
    assert wire.decode(wire.encode(ann), wire.WeightsAnnouncement) == ann
    # keep=2: the oldest version is gone, and no temp/trash directory is left behind.
    assert _versions(tmp_path / "store" / "run-a") == ["v00000002", "v00000003"]

    fetcher = _fetcher(cfg, KafkaConfig())
    for a, data in zip(anns[1:], blobs[1:], strict=True):
        path = fetcher.fetch(a)
        assert path.read_bytes() == data and sha256_file(path) == a.sha256
        assert (path.parent / "config.json").read_text() == '{"model_type": "toy"}'
    with pytest.raises(WeightFetchError, match="missing.*gave up after 3 attempts"):
        fetcher.fetch(anns[0])


def test_fs_never_deletes_the_version_just_published(tmp_path: Path) -> None:
    cfg = _fs_cfg(tmp_path, keep=2)
    pub = _pub(cfg, KafkaConfig(), Topics(), "r")
    src = tmp_path / "w.bin"
    for v in (10, 11, 12):
        _blob(src, 1000, seed=v)
        pub.publish(v, {MODEL_FILE: src})
    # A learner that rewound to a checkpoint publishes a lower number: it survives, the oldest other goes.
    _blob(src, 1000, seed=5)
    pub.publish(5, {MODEL_FILE: src})
    assert _versions(tmp_path / "store" / "r") == ["v00000005", "v00000011", "v00000012"]
    # Re-publishing a version replaces it; the old announcement no longer verifies.
    old = pub.publish(12, {MODEL_FILE: src})
    new_data = _blob(src, 2000, seed=99)
    new = pub.publish(12, {MODEL_FILE: src})
    fetcher = _fetcher(cfg, KafkaConfig())
    assert fetcher.fetch(new).read_bytes() == new_data
    with pytest.raises(WeightFetchError, match="size mismatch"):
        fetcher.fetch(old)


def test_fs_corrupt_file_is_retried_then_rejected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _fs_cfg(tmp_path)
    src = tmp_path / "w.bin"
    _blob(src, 3 * MiB, seed=1)
    ann = _pub(cfg, KafkaConfig(), Topics(), "r").publish(1, {MODEL_FILE: src})
    stored = tmp_path / "store" / ann.location

    def flip() -> None:
        with open(stored, "r+b") as f:
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 0xFF]))

    flip()
    fetcher = _fetcher(cfg, KafkaConfig())
    with caplog.at_level(logging.WARNING, "grpo_core.weights"), \
            pytest.raises(WeightFetchError, match=r"sha256 mismatch.*gave up after 3 attempts"):
        fetcher.fetch(ann)
    assert sum("retry" in r.getMessage() for r in caplog.records) == 2
    # A transient corruption that heals during the backoff (e.g. a volume catching up) is ridden out.
    patient = _fetcher(WeightStoreConfig(fs=cfg.fs, fetch_retries=5, fetch_backoff_s=0.05), KafkaConfig())
    healer = threading.Timer(0.08, flip)
    healer.start()
    assert patient.fetch(ann) == stored
    healer.join()


def test_fs_version_deleted_while_being_verified_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_core.weights.fs as ws

    cfg = _fs_cfg(tmp_path, keep=1)
    src = tmp_path / "w.bin"
    _blob(src, MiB, seed=1)
    pub = _pub(cfg, KafkaConfig(), Topics(), "r")
    ann = pub.publish(1, {MODEL_FILE: src})
    real_pump = ws.pump

    def pump_then_gc(*args: object, **kwargs: object) -> int:  # the learner's GC strikes while this fetcher hashes
        n = real_pump(*args, **kwargs)
        monkeypatch.setattr(ws, "pump", real_pump)
        pub.publish(2, {MODEL_FILE: src})
        return n

    monkeypatch.setattr(ws, "pump", pump_then_gc)
    with pytest.raises(WeightFetchError, match="missing"):
        _fetcher(cfg, KafkaConfig()).fetch(ann)
    assert _versions(tmp_path / "store" / "r") == ["v00000002"]


def test_fs_real_safetensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    tensors = {"w": torch.randn(64, 128), "b": torch.arange(10, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    cfg = _fs_cfg(tmp_path)
    ann = _pub(cfg, KafkaConfig(), Topics(), "st").publish(0, {MODEL_FILE: tmp_path / "m.safetensors"})
    loaded = load_file(str(_fetcher(cfg, KafkaConfig()).fetch(ann)))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


# ------------------------------------------------------------------------------------------ kafka store


def test_kafka_round_trip_and_cache(kafka_cfg: KafkaConfig, topics: Topics, tmp_path: Path) -> None:
    cfg = _kafka_store(tmp_path / "cache")
    data = _blob(tmp_path / "w.bin", 20 * MiB + 123, seed=7)
    pub = _pub(cfg, kafka_cfg, topics, "run-k")
    fetcher = _fetcher(cfg, kafka_cfg, topics)
    try:
        ann = pub.publish(1, {MODEL_FILE: tmp_path / "w.bin", "config.json": tmp_path / "w.bin"})
        assert (ann.store, ann.num_chunks, ann.chunk_bytes, ann.size_bytes) == ("kafka", 21, MiB, len(data))
        assert ann.location == f"{topics.weight_data}:0:0"
        path = fetcher.fetch(ann)
        assert path == tmp_path / "cache" / "run-k" / "v00000001" / MODEL_FILE
        assert path.read_bytes() == data
        assert fetcher.fetch(ann) == path  # cache hit, verified again
        path.write_bytes(b"stale")  # a damaged cache entry is downloaded again, not trusted
        assert fetcher.fetch(ann).read_bytes() == data
        assert _versions(path.parent.parent) == ["v00000001"]  # no temp files left in the cache
    finally:
        pub.close()
        fetcher.close()


def _send_chunk(producer: KafkaProducer, topic: str, run: str, version: int, data: bytes, chunk: int,
                index: int) -> FutureRecordMetadata:
    """Send chunk ``index`` of ``data`` by hand, as a second publisher sharing the topic would."""
    record = wire.WeightChunk(run=run, version=version, index=index, num_chunks=-(-len(data) // chunk),
                              data=data[index * chunk:(index + 1) * chunk])
    return producer.send(topic, key=f"{run}/{version}".encode(), value=wire.encode(record))


def test_kafka_interleaved_runs_and_versions_are_not_mixed(kafka_cfg: KafkaConfig, topics: Topics,
                                                           tmp_path: Path) -> None:
    chunk, topic = 256 * 1024, topics.weight_data
    cfg = _kafka_store(tmp_path / "cache", chunk)
    pub = _pub(cfg, kafka_cfg, topics, "A")
    producer = make_producer(kafka_cfg, "test", compression_type=None)
    fetcher = _fetcher(cfg, kafka_cfg, topics)
    try:
        a1 = _blob(tmp_path / "a1", 2 * MiB, seed=1)
        ann_a1 = pub.publish(1, {MODEL_FILE: tmp_path / "a1"})
        # An abandoned first attempt at A v2 (same key, other bytes), then A v2 and B v1 chunk by chunk, alternating.
        a2, b1, junk = (np.random.default_rng(s).bytes(2 * MiB - s) for s in (2, 3, 4))
        for i in range(2):
            _send_chunk(producer, topic, "A", 2, junk, chunk, i)
        futs_a, futs_b = [], []
        for i in range(-(-len(a2) // chunk)):
            futs_a.append(_send_chunk(producer, topic, "A", 2, a2, chunk, i))
            futs_b.append(_send_chunk(producer, topic, "B", 1, b1, chunk, i))
        producer.flush()
        anns = {}
        for run, data, futs in (("A", a2, futs_a), ("B", b1, futs_b)):
            first = futs[0].get(timeout=30)
            anns[run] = wire.WeightsAnnouncement(
                run=run, version=2 if run == "A" else 1, store="kafka", location=f"{topic}:0:{first.offset}",
                sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                num_chunks=len(futs), chunk_bytes=chunk, published_at=wire.now())
        assert fetcher.fetch(anns["B"]).read_bytes() == b1
        assert fetcher.fetch(anns["A"]).read_bytes() == a2
        assert fetcher.fetch(ann_a1).read_bytes() == a1
        # A bare-topic location makes the fetcher scan by time: it passes the abandoned attempt and restarts.
        bare = _fetcher(_kafka_store(tmp_path / "bare", chunk), kafka_cfg, topics)
        anns["A"].location = topic
        assert bare.fetch(anns["A"]).read_bytes() == a2
        bare.close()
    finally:
        pub.close()
        producer.close()
        fetcher.close()


def test_kafka_stream_assembles_versions_while_they_are_published(kafka_cfg: KafkaConfig, topics: Topics,
                                                                  tmp_path: Path) -> None:
    chunk, topic = MiB, topics.weight_data
    cfg = _kafka_store(tmp_path / "cache", chunk, fetch_retries=0)
    pub = _pub(cfg, kafka_cfg, topics, "s")
    early = _blob(tmp_path / "v1", 3 * MiB + 5, seed=11)
    ann1 = pub.publish(1, {MODEL_FILE: tmp_path / "v1"})  # before the stream starts: downloaded on demand
    producer = make_producer(kafka_cfg, "test", compression_type=None)
    fetcher = _fetcher(cfg, kafka_cfg, topics, stream_run="s")
    assert fetcher.stream is not None
    try:
        assert fetcher.fetch(ann1).read_bytes() == early and fetcher.stream.hits == 0
        data = _blob(tmp_path / "v2", 6 * MiB + 17, seed=12)
        for i in range(2):  # an abandoned attempt at v2 and another run's chunks, interleaved
            _send_chunk(producer, topic, "s", 2, np.random.default_rng(i).bytes(6 * MiB), chunk, i)
            _send_chunk(producer, topic, "s2", 2, np.random.default_rng(i).bytes(2 * MiB), chunk, i)
        producer.flush()
        ann2 = pub.publish(2, {MODEL_FILE: tmp_path / "v2"})
        path = fetcher.fetch(ann2)
        assert path == tmp_path / "cache" / "s" / "v00000002" / MODEL_FILE
        assert path.read_bytes() == data and fetcher.stream.hits == 1
        _blob(tmp_path / "v3", 2 * MiB, seed=13)
        ann3 = pub.publish(3, {MODEL_FILE: tmp_path / "v3"})
        lie = dataclasses.replace(ann3, sha256="0" * 64)
        with pytest.raises(WeightFetchError, match="sha256 mismatch"):  # the stream's copy is not trusted either
            fetcher.fetch(lie)
        assert fetcher.stream.hits == 1
        leftovers = [p.name for p in (tmp_path / "cache" / "s").iterdir() if p.name.startswith(".")]
        assert [name for name in leftovers if not name.startswith(".stream-spare-")] == []  # the spare stays
    finally:
        pub.close()
        producer.close()
        fetcher.close()


def test_kafka_stream_writes_each_version_over_the_spare_it_prepared(kafka_cfg: KafkaConfig, topics: Topics,
                                                                     tmp_path: Path) -> None:
    """After each version the stream fills a spare file of that size with zeros; the next version overwrites it
    and is cut to its own size, smaller or larger: the bytes are exactly the version's, never trailing zeros."""
    cfg = _kafka_store(tmp_path / "cache", fetch_retries=0)
    pub = _pub(cfg, kafka_cfg, topics, "p")
    fetcher = _fetcher(cfg, kafka_cfg, topics, stream_run="p")
    stream = fetcher.stream
    assert stream is not None
    try:
        for version, size in enumerate((5 * MiB + 7, 2 * MiB + 3, 7 * MiB + 1), start=1):
            data = _blob(tmp_path / f"v{version}", size, seed=30 + version)
            assert fetcher.fetch(pub.publish(version, {MODEL_FILE: tmp_path / f"v{version}"})).read_bytes() == data
        assert (stream.hits, stream.spares_used) == (3, 2)
        assert stream.spare is not None
        deadline = time.monotonic() + 30
        spare = stream.spare.path
        # The spare is created on a thread of its own: right after the version it may not exist yet.
        while (spare.stat().st_size if spare.exists() else 0) < 7 * MiB + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spare.read_bytes() == bytes(7 * MiB + 1)  # ready for the next version
    finally:
        pub.close()
        fetcher.close()
    assert [p.name for p in (tmp_path / "cache" / "p").iterdir() if p.name.startswith(".")] == []


def test_kafka_write_errors_fail_the_fetch_cleanly(kafka_cfg: KafkaConfig, topics: Topics, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are written and hashed on a writer thread: a disk error there must surface (retried, then reported),
    never hang the fetch or leave a partial file; the stream drops the version and the download takes over."""
    cfg = _kafka_store(tmp_path / "cache", fetch_retries=1, fetch_backoff_s=0.01)
    real_write, failing = chunks.write_all, {"prefix": ".stream-"}

    def write(dst: BinaryIO, data: memoryview | bytes) -> None:
        if Path(str(dst.name)).name.startswith(failing["prefix"]):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(dst, data)

    monkeypatch.setattr(chunks, "write_all", write)
    pub = _pub(cfg, kafka_cfg, topics, "w")
    fetcher = _fetcher(cfg, kafka_cfg, topics, stream_run="w")
    assert fetcher.stream is not None
    try:
        data = _blob(tmp_path / "v1", 5 * MiB + 3, seed=21)
        path = fetcher.fetch(pub.publish(1, {MODEL_FILE: tmp_path / "v1"}))  # the stream's writes fail
        assert path.read_bytes() == data and fetcher.stream.hits == 0 and fetcher.stream.current is None
        failing["prefix"] = ".tmp-"  # now the download's writes fail, the stream's succeed
        _blob(tmp_path / "v2", 3 * MiB, seed=22)
        ann2 = pub.publish(2, {MODEL_FILE: tmp_path / "v2"})
        assert fetcher.fetch(ann2).exists() and fetcher.stream.hits == 1
        (tmp_path / "cache" / "w" / "v00000002" / MODEL_FILE).unlink()
        fetcher.stream.close()
        fetcher.stores["kafka"].stream = None  # type: ignore[attr-defined]
        with pytest.raises(WeightFetchError, match="No space left on device.*2 attempts"):
            fetcher.fetch(ann2)
        assert sorted(p.name for p in (tmp_path / "cache" / "w").iterdir()) == ["v00000001", "v00000002"]
        assert not (tmp_path / "cache" / "w" / "v00000002" / MODEL_FILE).exists()
        assert [t.name for t in threading.enumerate() if t.name == "weights-writer"] == []
    finally:
        pub.close()
        fetcher.close()


def test_kafka_tampered_or_deleted_chunks_are_reported(kafka_cfg: KafkaConfig, topics: Topics, admin:
                                                       KafkaAdminClient, tmp_path: Path) -> None:
    cfg = _kafka_store(tmp_path / "cache", fetch_backoff_s=0.01)
    _blob(tmp_path / "w", 3 * MiB, seed=4)
    pub = _pub(cfg, kafka_cfg, topics, "t")
    fetcher = _fetcher(cfg, kafka_cfg, topics)
    try:
        ann = pub.publish(1, {MODEL_FILE: tmp_path / "w"})
        ann.sha256 = "0" * 64
        t0 = time.monotonic()
        with pytest.raises(WeightFetchError, match="sha256 mismatch"):
            fetcher.fetch(ann)
        assert time.monotonic() - t0 < 10  # immutable records: not retried
        assert not (tmp_path / "cache" / "t" / "v00000001" / MODEL_FILE).exists()  # nothing unverified kept
        ann2 = pub.publish(2, {MODEL_FILE: tmp_path / "w"})
        admin.delete_records({TopicPartition(topics.weight_data, 0): 5})  # as retention would
        with pytest.raises(WeightFetchError, match="retention"):
            fetcher.fetch(ann2)
    finally:
        pub.close()
        fetcher.close()


# ------------------------------------------------------------------------------------------ announcements


def _ann(run: str, version: int) -> wire.WeightsAnnouncement:
    return wire.WeightsAnnouncement(run=run, version=version, store="fs", sha256=f"{version:064x}", size_bytes=1,
                                    location=f"{run}/v{version:08d}/{MODEL_FILE}", published_at=wire.now())


def test_latest_announcement(kafka_cfg: KafkaConfig, topics: Topics, tmp_path: Path) -> None:
    cfg = _fs_cfg(tmp_path)
    pubs = {run: _pub(cfg, kafka_cfg, topics, run) for run in ("A", "B")}
    raw = make_producer(kafka_cfg, "test")
    topic = topics.weights
    try:
        assert latest_announcement(kafka_cfg, topic, "A") is None  # empty topic
        for v in (1, 2):
            pubs["A"].announce(_ann("A", v))
        pubs["B"].announce(_ann("B", 1))
        raw.send(topic, key=b"A", value=b"\x00not msgpack")  # garbage under the run's own key
        raw.send(topic, key=b"A", value=wire.encode(_ann("B", 9)))  # mis-keyed
        a3 = _ann("A", 3)
        pubs["A"].announce(a3)
        raw.send(topic, key=b"A", value=wire.encode(wire.WeightChunk(run="A", version=4, index=0, num_chunks=1,
                                                                     data=b"x")))  # wrong record type
        raw.send(topic, key=b"zz", value=b"garbage")
        raw.flush()
        assert latest_announcement(kafka_cfg, topic, "A") == a3
        b = latest_announcement(kafka_cfg, topic, "B")
        assert b is not None and (b.run, b.version) == ("B", 1)
        assert latest_announcement(kafka_cfg, topic, "nobody") is None
        with pytest.raises(WeightFetchError, match="not found"):
            latest_announcement(kafka_cfg, "no-such-topic-xyz", "A", timeout_s=5)
    finally:
        raw.close()
        for p in pubs.values():
            p.close()


def test_the_publisher_sends_without_lingering(kafka_cfg: KafkaConfig, topics: Topics, tmp_path: Path) -> None:
    """The learner waits for its announcement's ack at every publish, and a weight chunk fills a batch on its
    own: lingering for more records to batch with only delays them. With the clients' 5 ms an announcement took
    10.5 ms of the learner's step (1.6 ms of it CPU), without it 5.0 ms."""
    pub = _pub(_fs_cfg(tmp_path), kafka_cfg, topics, "run-l")
    other = make_producer(kafka_cfg, "test")
    try:
        assert pub.producer.config["linger_ms"] == 0
        assert other.config["linger_ms"] == 5  # the other roles' records are sent many at a time
        ann = _ann("run-l", 1)
        pub.announce(ann)
        assert latest_announcement(kafka_cfg, topics.weights, "run-l") == ann
    finally:
        other.close()
        pub.close()


# ------------------------------------------------------------------------------------------ the swap benchmark


def test_swap_bench_measures_every_store(kafka_cfg: KafkaConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``bench producer``'s swap part runs end to end (learner in a child process) and says when it streamed."""
    monkeypatch.setattr(swap, "WEIGHTS", tmp_path)
    monkeypatch.setattr(swap, "GAP_S", 0.0)
    admin = make_admin(kafka_cfg)
    before = set(admin.list_topics())
    swap.measure_swaps(kafka_cfg.bootstrap, [1, 3])  # the whole part, its topics created and deleted
    lines = [line for line in capsys.readouterr().out.splitlines() if " MB: " in line]
    assert [line.split(" MB: ")[0].split() for line in lines] == [
        ["fs", "1"], ["fs", "3"], ["kafka", "1"], ["kafka", "3"], ["kafka", "stream", "1"], ["kafka", "stream", "3"]]
    assert all("swap latency" in line and "fixed latency dominates" in line for line in lines)
    assert ["fetch+verify streamed" in line for line in lines] == [False] * 4 + [True] * 2
    assert list(tmp_path.iterdir()) == []  # the random files, stores and caches are cleaned up
    try:
        assert set(admin.list_topics()) <= before  # and so are the bench's topics
    finally:
        admin.close()


def test_a_publish_the_broker_dropped_is_uploaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kafka store's upload fails when the broker is gone longer than the client's delivery timeout; the
    publisher waits and uploads the version again (receivers restart its assembly at chunk 0)."""
    from kafka.errors import KafkaTimeoutError

    import grpo_core.retry

    monkeypatch.setattr(grpo_core.retry.time, "sleep", lambda s: None)
    pub = _pub(_fs_cfg(tmp_path), KafkaConfig(), Topics(), "run-r")
    real, calls = pub.store.publish, []

    def flaky(*args: object) -> wire.WeightsAnnouncement:
        calls.append(1)
        if len(calls) < 3:
            raise KafkaTimeoutError("Batch for weight-data-0 expired")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pub.store, "publish", flaky)
    _blob(tmp_path / "w.bin", MiB, seed=0)
    ann = pub.publish(5, {MODEL_FILE: tmp_path / "w.bin"})
    assert len(calls) == 3 and ann.version == 5 and ann.sha256 == sha256_file(tmp_path / "w.bin")


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_publish_bench_reports_both_ways_for_both_stores(kafka_cfg: KafkaConfig, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``bench producer``'s headline in a short mode: every store and way is measured and the ratio printed."""
    from grpo_stream.bench import publish

    monkeypatch.setattr(swap, "WEIGHTS", tmp_path)
    monkeypatch.setattr(swap, "GAP_S", 0.0)
    publish.report(kafka_cfg, swap.fresh_topics(kafka_cfg), size_mb=20)
    out = capsys.readouterr().out
    rows = [line.split(":")[0].split() for line in out.splitlines() if " s/GB " in line]
    assert rows == [["fs", "via", "file"], ["fs", "direct"], ["kafka", "stream", "via", "file"],
                    ["kafka", "stream", "direct"]], out
    assert out.count("direct / via file = ") == 2 and "inf" not in out
    assert list(tmp_path.iterdir()) == []


def test_fs_writes_the_next_version_over_the_retired_one(tmp_path: Path) -> None:
    """The GC keeps the newest retired model file as the spare; the next version is written over it (same inode,
    page-cache pages reused) and is byte-exact, sizes differing or not."""
    from grpo_core.weights.fs import SPARE

    cfg = _fs_cfg(tmp_path, keep=2)
    pub = _pub(cfg, KafkaConfig(), Topics(), "run-s")
    run_dir = tmp_path / "store" / "run-s"
    for v, size in ((1, 3 * MiB), (2, 3 * MiB), (3, 2 * MiB)):
        _blob(tmp_path / f"w{v}.bin", size, seed=v)
        pub.publish(v, {MODEL_FILE: tmp_path / f"w{v}.bin"})
    spare = run_dir / SPARE
    assert spare.exists() and spare.stat().st_size == 3 * MiB  # v1's file, retired when v3 came
    inode = spare.stat().st_ino
    data = _blob(tmp_path / "w4.bin", 1 * MiB + 5, seed=4)
    ann = pub.publish(4, {MODEL_FILE: tmp_path / "w4.bin"})
    path = run_dir / "v00000004" / MODEL_FILE
    assert path.stat().st_ino == inode and path.read_bytes() == data  # written over the spare, cut to size
    assert ann.sha256 == sha256_file(path) and ann.size_bytes == len(data)
    assert spare.exists() and spare.stat().st_ino != inode  # v2's file is the next spare
    assert _fetcher(cfg, KafkaConfig()).fetch(ann).read_bytes() == data


@pytest.mark.parametrize("size", [0, 1, 5000, pytest.param(3 * 8 * MiB + 7, marks=pytest.mark.slow)])
@pytest.mark.parametrize("read_at_most", [None, 1000])
def test_pump_copies_and_hashes_every_byte(size: int, read_at_most: int | None) -> None:
    """One piece (a small model) is hashed inline, more go through the hashing thread; short reads (a pipe, a
    socket) must lose nothing either way."""
    import io

    from grpo_core.weights.common import pump

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()

    class Short(io.RawIOBase):
        def __init__(self) -> None:
            self.src = io.BytesIO(data)

        def readinto(self, b: bytearray | memoryview) -> int:
            return self.src.readinto(memoryview(b)[:read_at_most] if read_at_most else b)

    for hint in (None, size, max(size // 3, 1), size * 2 + 1):  # a wrong size costs speed, never bytes
        hasher, out = hashlib.sha256(), io.BytesIO()
        assert pump(Short(), hasher, out, hint) == size
        assert out.getvalue() == data and hasher.hexdigest() == hashlib.sha256(data).hexdigest()


def test_publishing_and_verifying_a_small_model_allocates_buffers_of_its_size(tmp_path: Path) -> None:
    """A 1 MB model published and fetched at every step used to zero-fill two 8 MiB buffers per file (and per
    800-byte config.json): ~10 ms of each ~40 ms publish here. The buffers now follow the file's size."""
    import tracemalloc

    cfg = _fs_cfg(tmp_path, keep=3)
    src = tmp_path / "w.bin"
    _blob(src, MiB, seed=3)
    pub, fetcher = _pub(cfg, KafkaConfig(), Topics(), "r"), _fetcher(cfg, KafkaConfig())
    tracemalloc.start()
    try:
        ann = pub.publish(1, {MODEL_FILE: src, "config.json": Payload.of_bytes(b"{}" * 400)})
        _, publish_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fetcher.fetch(ann)
        _, fetch_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert publish_peak < 4 * MiB and fetch_peak < 4 * MiB, (publish_peak, fetch_peak)
