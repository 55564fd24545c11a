"""The ``kafka`` weight store, for deployments without shared storage.

``model.safetensors`` is streamed as :class:`~grpo_core.wire.WeightChunk` records (``chunk_bytes`` each,
uncompressed: float weights do not compress and lz4 would only cost CPU) to the weight-data topic keyed
``f"{run}/{version}"`` (one partition, so in order), all acknowledged before the announcement is returned. Extra
files are *not* shipped (producers already have the model's config and tokenizer). ``location`` is
``"<topic>:<partition>:<offset of chunk 0>"``: the fetcher seeks straight to the first chunk instead of searching
the log. (A bare ``"<topic>"`` is also accepted: the fetcher then scans every partition from ``published_at``
minus one hour, found with ``offsets_for_times``.) The fetcher reassembles the chunks into its local cache
``<cache_dir>/<run>/v<version:08d>/model.safetensors`` (the fs store's layout) and keeps the newest
``cache_keep`` versions there. Garbage collection on Kafka is the weight-data topic's ``retention.ms``: it must
outlast the time a producer may need to catch up on the latest announcement (a learner idle for longer than the
retention leaves an announcement whose chunks are gone; the fetcher then reports exactly that). With a
:class:`~grpo_core.weights.stream.ChunkStream`, versions are assembled while they are uploaded; whatever the
stream cannot vouch for is downloaded as here. Kafka records are immutable, so a reassembled file with the wrong
sha256 stays wrong: that fails at once, without retries.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import Consumer, Partition, Producer, SendFuture, make_producer, poll
from grpo_core.weights.chunks import ChunkAssembler, chunk_consumer
from grpo_core.weights.common import (
    MODEL_FILE,
    SEND_TIMEOUT_S,
    STALL_S,
    Transient,
    WeightFetchError,
    gc_versions,
    parse_kafka_location,
    sha256_file,
    version_dir_name,
)
from grpo_core.weights.config import KafkaStoreConfig
from grpo_core.weights.payload import Payload, open_source
from grpo_core.weights.stream import ChunkStream

log = logging.getLogger("grpo_core.weights")

_FALLBACK_LOOKBACK_S = 3600.0  # bare-topic locations: scan from published_at minus this
_INFLIGHT_BYTES = 64 * (1 << 20)  # unacknowledged chunk bytes a publisher holds at most


class KafkaStore:
    """Publish chunk records to ``topic``; fetch versions into ``cfg.cache_dir`` (streamed, else downloaded)."""

    kind = "kafka"

    def __init__(self, cfg: KafkaStoreConfig, kafka: KafkaConfig, topic: str,
                 stream: ChunkStream | None = None, producer: Callable[[], Producer] | None = None) -> None:
        """``producer``: where the publisher's (uncompressed) Kafka producer comes from, created on first use;
        by default one of the store's own."""
        self.cfg, self.kafka, self.topic, self.stream = cfg, kafka, topic, stream
        self.cache_dir = Path(cfg.cache_dir)
        self._make_producer, self._producer = producer, cast(Producer | None, None)
        self._consumer: Consumer | None = None

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            make = self._make_producer or (lambda: make_producer(self.kafka, "weights", compression_type=None))
            self._producer = make()
        return self._producer

    # -- publishing

    def publish(self, run: str, version: int, files: Mapping[str, Path | Payload]) -> wire.WeightsAnnouncement:
        if len(files) > 1:
            log.info("weights: kafka store ships only %s; not sending %s", MODEL_FILE,
                     sorted(set(files) - {MODEL_FILE}))
        return self._publish(run, version, files[MODEL_FILE])

    def _publish(self, run: str, version: int, src: Path | Payload) -> wire.WeightsAnnouncement:
        topic, key, chunk = self.topic, f"{run}/{version}".encode(), self.cfg.chunk_bytes
        hasher = hashlib.sha256()
        # kafka-python 3 has no buffer_memory bound: cap the unacknowledged chunks ourselves so a 10 GB file
        # never sits in the send queue whole.
        window = max(2, _INFLIGHT_BYTES // chunk)
        pending: deque[SendFuture] = deque()
        first: Any = None
        f, size = open_source(src)
        with f:
            num_chunks = max(1, -(-size // chunk))
            for index in range(num_chunks):
                data = _read_exact(f, min(chunk, size - index * chunk), src)
                hasher.update(data)
                record = wire.WeightChunk(run=run, version=version, index=index, num_chunks=num_chunks,
                                          data=data)
                pending.append(self.producer.send(topic, key=key, value=wire.encode(record)))
                while len(pending) >= window or (first is None and index == num_chunks - 1):
                    meta = pending.popleft().get(timeout=SEND_TIMEOUT_S)  # raises the send error, if any
                    first = first or meta
            if f.read(1):
                raise OSError(f"{src}: grew while it was being published")
        self.producer.flush(timeout=SEND_TIMEOUT_S)
        for fut in pending:
            fut.get(timeout=SEND_TIMEOUT_S)
        assert first is not None
        return wire.WeightsAnnouncement(
            run=run, version=version, store="kafka", location=f"{topic}:{first.partition}:{first.offset}",
            sha256=hasher.hexdigest(), size_bytes=size, num_chunks=num_chunks, chunk_bytes=chunk,
            published_at=wire.now())

    def gc(self, run: str, protect: str) -> list[str]:
        """Kafka's side is the weight-data topic's retention; this prunes the receiver's cache."""
        return gc_versions(self.cache_dir / run, self.cfg.cache_keep, protect)

    # -- fetching

    def cache_path(self, ann: wire.WeightsAnnouncement) -> Path:
        """Where a version is reassembled: ``<cache_dir>/<run>/v<version:08d>/model.safetensors``."""
        return self.cache_dir / ann.run / version_dir_name(ann.version) / MODEL_FILE

    def fetch(self, ann: wire.WeightsAnnouncement) -> Path:
        dest = self.cache_path(ann)
        if dest.exists():  # cache hit (a restart, a second fetch): verify again, a cache is no proof
            if dest.stat().st_size == ann.size_bytes and sha256_file(dest) == ann.sha256:
                return dest
            log.warning("weights: cached %s does not match the announcement; downloading again", dest)
            dest.unlink(missing_ok=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.stream is not None and self.stream.take(ann, dest):
            self.gc(ann.run, protect=dest.parent.name)
            return dest
        starts = self._start_offsets(ann)
        tmp = dest.parent.parent / f".tmp-{dest.parent.name}-{uuid.uuid4().hex[:8]}.part"
        try:
            with (open(tmp, "wb", buffering=0) as out,
                  ChunkAssembler(ann.run, ann.version, ann.num_chunks, out, max_bytes=ann.size_bytes) as assembler):
                self._read_chunks(ann, starts, assembler)
                assembler.verify(ann)
            os.replace(tmp, dest)  # concurrent fetchers sharing the cache each replace with identical bytes
        finally:
            tmp.unlink(missing_ok=True)
        self.gc(ann.run, protect=dest.parent.name)
        return dest


    def _kafka_consumer(self) -> Consumer:
        """One group-less consumer, reused across fetches (reconnecting per version costs more than a chunk)."""
        if self._consumer is None:
            self._consumer = chunk_consumer(self.kafka, "weights-fetch")
        return self._consumer

    def _start_offsets(self, ann: wire.WeightsAnnouncement) -> dict[Partition, int]:
        """Where to start reading: chunk 0's offset from the location, else a timestamp lookup."""
        try:
            topic, partition, offset = parse_kafka_location(ann.location)
        except ValueError as exc:
            raise WeightFetchError(str(exc)) from None
        consumer = self._kafka_consumer()
        if partition is not None and offset is not None:
            tp = Partition(topic, partition)
            begin = consumer.beginning_offsets([tp])[tp]
            if offset < begin:
                raise WeightFetchError(
                    f"chunks deleted by retention: chunk 0 was at offset {offset}, {topic}[{partition}] now starts at "
                    f"{begin}; raise topics.weight_data.retention_ms or have the learner publish again")
            return {tp: offset}
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise Transient(f"weight-data topic {topic!r} not found")
        tps = [Partition(topic, p) for p in sorted(parts)]
        since_ms = int(max(0.0, ann.published_at - _FALLBACK_LOOKBACK_S) * 1000)
        found = consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = consumer.end_offsets(tps)
        return {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}

    def _read_chunks(self, ann: wire.WeightsAnnouncement, starts: dict[Partition, int],
                     assembler: ChunkAssembler) -> None:
        """Feed the assembler this version's chunks until it is complete. The end offsets are taken first:
        the publisher flushed every chunk before announcing, so reaching them with chunks missing is final."""
        consumer = self._kafka_consumer()
        tps = list(starts)
        consumer.assign(tps)
        for tp, offset in starts.items():
            consumer.seek(tp, offset)
        ends = consumer.end_offsets(tps)
        key = f"{ann.run}/{ann.version}".encode()
        stall_deadline = time.monotonic() + STALL_S
        while not assembler.complete:
            if all(consumer.position(tp) >= ends[tp] for tp in tps):
                raise WeightFetchError(f"incomplete: {assembler.next_index} of {ann.num_chunks} chunks found up to "
                                       f"the end of {sorted(map(str, tps))} (deleted by retention?)")
            batches = poll(consumer, 500)
            if not batches:
                if time.monotonic() > stall_deadline:
                    raise Transient(f"no chunk data from the broker for {STALL_S:.0f}s")
                continue
            stall_deadline = time.monotonic() + STALL_S
            for msgs in batches.values():
                for msg in msgs:
                    if msg.key == key:
                        assembler.add(msg)
                        if assembler.complete:
                            return

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._producer is not None and self._make_producer is None:  # a borrowed producer is its owner's to close
            self._producer.close()
        self._producer = None


def _read_exact(f: io.RawIOBase, n: int, src: Path | Payload) -> bytes:
    data = f.read(n)
    while len(data) < n:  # raw reads may return short; only an empty read means end of file
        more = f.read(n - len(data))
        if not more:
            raise OSError(f"{src}: file shrank while it was being published")
        data += more
    return data
