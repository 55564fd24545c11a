"""The weight store: how the learner publishes policy weights and how producers fetch them.

Weight bytes never travel in a :class:`~grpo_stream.wire.WeightsAnnouncement`; the announcement says where they
are and what their sha256 is. Two stores:

``fs`` -- a directory shared by the learner and the producers (NFS, a k8s RWX volume, one host's disk)::

    <root>/<run>/v<version:08d>/model.safetensors     # the announced, hashed file
    <root>/<run>/v<version:08d>/config.json ...       # optional extra files passed to publish()

  A version is written into ``<root>/<run>/.tmp-...`` (same parent, so the rename is atomic), fsynced, then
  renamed into place: a reader sees a complete version or none. ``location`` is the model file's path
  *relative to the store root* (``<run>/v00000003/model.safetensors``), so the learner and the producers may
  mount the volume at different paths; each resolves it against its own ``root`` (an absolute ``location`` is
  used as is). The fetcher verifies the file in place (no copy: the swap budget is < 1 s/GB) and returns its
  path. Garbage collection keeps the newest ``keep`` versions and never the version just published;
  a doomed version is first renamed to ``.trash-...`` and then deleted, so readers never see half of one. A
  producer that has the file open keeps reading it (POSIX unlink semantics); one that comes too late gets a
  :class:`WeightFetchError` saying "missing" after the retries, and should move on to the newest announcement.

``kafka`` -- for deployments without shared storage. ``model.safetensors`` is streamed as
  :class:`~grpo_stream.wire.WeightChunk` records (``chunk_bytes`` each, uncompressed: float weights do not
  compress and lz4 would only cost CPU) to the weight-data topic keyed ``f"{run}/{version}"`` (one partition,
  so in order), all acknowledged before the announcement is returned. Extra files are *not* shipped (producers
  already have the model's config and tokenizer). ``location`` is ``"<topic>:<partition>:<offset of chunk
  0>"``: the fetcher seeks straight to the first chunk instead of searching the log. (A bare ``"<topic>"`` is
  also accepted: the fetcher then scans every partition from ``published_at`` minus one hour, found with
  ``offsets_for_times``.) The fetcher reassembles the chunks into its local cache
  ``<cache_dir>/<run>/v<version:08d>/model.safetensors`` (same layout as the fs store), writing and hashing
  on two threads of their own while the next chunks arrive, and keeps the newest ``keep`` versions there.
  Garbage collection on Kafka is the weight-data topic's ``retention.ms``: it must outlast the time a producer
  may need to catch up on the latest announcement (a learner idle for longer than the retention leaves an
  announcement whose chunks are gone; the fetcher then reports exactly that). With ``stream`` on (the default
  for producers), a :class:`ChunkStream` tails the topic and assembles each new version while the learner is
  still uploading it, so after the announcement a swap only waits for the last chunks; whatever the stream
  cannot vouch for is downloaded as above.

Every fetch failure surfaces as one exception type, :class:`WeightFetchError`, after the retries that make
sense: a missing/corrupt file on a shared volume and broker errors are retried with exponential backoff
(``fetch_retries``, ``fetch_backoff_s``); facts that retrying cannot change (Kafka records are immutable, so a
reassembled file with the wrong sha256 stays wrong; chunks deleted by retention stay deleted) fail at once.
Unverified bytes are never returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaError
from kafka.producer.future import FutureRecordMetadata, RecordMetadata

from grpo_stream import wire
from grpo_stream.config import KafkaConfig, TopicsConfig, TopicSpec, opt, require
from grpo_stream.fsutil import fsync_dir
from grpo_stream.kafka_io import make_consumer, make_producer, require_partitions, with_retry

log = logging.getLogger(__name__)

MiB = 1 << 20
MODEL_FILE = "model.safetensors"
# Bytes a chunk record needs beyond its data: msgpack field names and values, record and batch headers, key.
CHUNK_OVERHEAD_BYTES = 64 * 1024
_IO_BYTES = 8 * MiB  # read/hash/write granularity: large enough that per-call overhead vanishes
_STALE_S = 3600.0  # .tmp-/.trash-/.stream- leftovers of a crashed process older than this are removed by the GC
_FALLBACK_LOOKBACK_S = 3600.0  # bare-topic locations: scan from published_at minus this
_STALL_S = 60.0  # a chunk download that receives nothing for this long is retried
_SEND_TIMEOUT_S = 120.0
_INFLIGHT_BYTES = 64 * MiB  # unacknowledged chunk bytes a publisher holds at most
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_VERSION_DIR_RE = re.compile(r"v(\d+)")
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


class WeightFetchError(RuntimeError):
    """Weights could not be obtained or verified; the message names the version, the location and why."""


class _Transient(Exception):
    """A failure worth retrying: file missing or being replaced, hash mismatch on a shared volume, a stall."""


# ------------------------------------------------------------------------------------------ config


@dataclass
class WeightStoreConfig:
    """Where published weights live and how receivers fetch them (see the module docstring for layouts)."""

    kind: Literal["fs", "kafka"] = opt(
        "fs", "fs: a directory shared by learner and producers. kafka: chunk records on the weight-data topic, "
              "for deployments without shared storage.")
    root: str = opt(".cache/weights", "fs: the shared store directory. kafka: the receivers' local cache directory.")
    keep: int = opt(3, "Versions kept in the fs store (and in each receiver's cache); the newest are kept.")
    chunk_bytes: int = opt(
        8 * MiB, "kafka: bytes of weights per chunk record; chunk_bytes + 64 KiB must fit kafka.max_record_bytes "
                 "and topics.weight_data.max_message_bytes.")
    fetch_retries: int = opt(5, "Retries of a failed fetch (missing/corrupt file, broker error) before giving up.")
    fetch_backoff_s: float = opt(0.5, "First retry delay; doubles per retry, capped at 10 s.")
    stream: bool = opt(
        True, "kafka, receivers: assemble each version's chunks while the learner publishes it (a background "
              "consumer), so a swap waits only for the last chunks after the announcement instead of a full download. "
              "Costs a consumer thread and, between versions, a spare file of one version's size in the cache.")

    def validate(self) -> None:
        require(bool(self.root), "weights.root: must not be empty")
        require(self.keep >= 1, f"weights.keep: must be >= 1 (got {self.keep}); 2+ gives slow producers slack")
        require(64 * 1024 <= self.chunk_bytes <= 1 << 30,
                f"weights.chunk_bytes: {self.chunk_bytes} not in [64 KiB, 1 GiB]; the default 8 MiB is a good choice")
        require(self.fetch_retries >= 0, f"weights.fetch_retries: must be >= 0 (got {self.fetch_retries})")
        require(self.fetch_backoff_s >= 0, f"weights.fetch_backoff_s: must be >= 0 (got {self.fetch_backoff_s})")

    def check_fits(self, kafka: KafkaConfig, spec: TopicSpec) -> None:
        """A chunk record must fit both the client's and the topic's record limit (kind=kafka only)."""
        limit = min(kafka.max_record_bytes, spec.max_message_bytes)
        require(self.chunk_bytes + CHUNK_OVERHEAD_BYTES <= limit,
                f"weights.chunk_bytes: {self.chunk_bytes} + {CHUNK_OVERHEAD_BYTES} bytes of record overhead exceeds "
                f"{limit} (min of kafka.max_record_bytes={kafka.max_record_bytes} and "
                f"topics.weight_data.max_message_bytes={spec.max_message_bytes}); set weights.chunk_bytes <= "
                f"{limit - CHUNK_OVERHEAD_BYTES} or raise both limits")


# ------------------------------------------------------------------------------------------ helpers


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 8 MiB pieces (constant memory whatever the file size)."""
    hasher = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        _pump(f, hasher)
    return hasher.hexdigest()


def version_dir_name(version: int) -> str:
    """``v00000042``: zero-padded so a directory listing sorts by version."""
    return f"v{version:08d}"


def check_run_name(run: str) -> str:
    """Run names become path components and chunk keys, so only ``[A-Za-z0-9._-]`` (no ``/``, no ``..``)."""
    if not _RUN_RE.fullmatch(run) or run in (".", ".."):
        raise ValueError(f"run name {run!r}: use 1-200 characters of [A-Za-z0-9._-], starting alphanumeric")
    return run


def _pump(src: BinaryIO, hasher: Any, dst: BinaryIO | None = None) -> int:
    """Copy ``src`` to its end into ``dst`` (if any) while hashing; one reusable buffer, no whole-file copy."""
    buf = bytearray(_IO_BYTES)
    view = memoryview(buf)
    total = 0
    while n := src.readinto(buf):
        piece = view[:n]
        hasher.update(piece)  # hashlib releases the GIL for large buffers
        if dst is not None:
            _write_all(dst, piece)
        total += n
    return total


def _write_all(dst: BinaryIO, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = dst.write(view)
        view = view[written:]




def _remove_tree(path: Path) -> None:
    """Rename aside first (atomic: readers see the version or nothing), then delete at leisure. On NFS a file
    another client holds open survives as ``.nfsXXXX`` and the rmtree leaves it; a later GC retries."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("weight store: cannot remove %s: %s", path, exc)
        return
    shutil.rmtree(trash, ignore_errors=True)


def _gc_versions(run_dir: Path, keep: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep`` version directories, never ``protect`` (the one just written,
    which may not be the highest number after a learner rewound to a checkpoint). Also sweeps stale
    ``.tmp-``/``.trash-`` leftovers of crashed processes. Returns the names deleted."""
    versions = sorted((int(m[1]), p) for p in run_dir.iterdir()
                      if (m := _VERSION_DIR_RE.fullmatch(p.name)) and p.is_dir())
    doomed = [p for _, p in versions[:-keep] if p.name != protect]
    for p in doomed:
        _remove_tree(p)
    now = time.time()
    for p in run_dir.iterdir():
        if p.name.startswith((".tmp-", ".trash-", ".stream-")):
            try:
                stale = now - p.lstat().st_mtime > _STALE_S
            except FileNotFoundError:
                continue
            if stale and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif stale:
                p.unlink(missing_ok=True)
    if doomed:
        log.info("weight store: removed %s from %s (keep=%d)", [p.name for p in doomed], run_dir, keep)
    return [p.name for p in doomed]


def _parse_kafka_location(location: str) -> tuple[str, int | None, int | None]:
    """``topic:partition:offset`` or a bare ``topic`` (Kafka topic names cannot contain ``:``)."""
    parts = location.split(":")
    if len(parts) == 1 and parts[0]:
        return parts[0], None, None
    if len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2])
    raise ValueError(f"kafka location {location!r}: expected 'topic:partition:offset' or 'topic'")


# ------------------------------------------------------------------------------------------ publishing


class WeightPublisher:
    """The learner's side: write a version to the store, then announce it on the compacted weights topic.

    ``publish`` and ``announce`` are separate so the learner can checkpoint in between (an announced version
    must always be restorable). Send failures propagate as ``KafkaError``; file errors as ``OSError``.
    """

    def __init__(self, cfg: WeightStoreConfig, kafka: KafkaConfig, topics: TopicsConfig, run: str,
                 producer: KafkaProducer | None = None) -> None:
        cfg.validate()
        if cfg.kind == "kafka":
            cfg.check_fits(kafka, topics.weight_data)
        self.cfg, self.kafka, self.topics, self.run = cfg, kafka, topics, check_run_name(run)
        self._producer, self._owns_producer = producer, producer is None

    @property
    def producer(self) -> KafkaProducer:
        """Created on first use: an fs publisher that never announces (tests, tools) needs no broker."""
        if self._producer is None:
            self._producer = make_producer(self.kafka, "weights", compression_type=None)
        return self._producer

    def publish(self, version: int, files: Mapping[str, str | os.PathLike[str]]) -> wire.WeightsAnnouncement:
        """Store ``files`` (name -> source path; ``model.safetensors`` required, e.g. ``config.json`` optional)
        as ``version`` and return the announcement to pass to :meth:`announce`. The kafka store ships only
        ``model.safetensors``."""
        if version < 0:
            raise ValueError(f"version: {version} < 0")
        if MODEL_FILE not in files:
            raise ValueError(f"files: {MODEL_FILE!r} is required, got {sorted(files)}")
        for name in files:
            if not _NAME_RE.fullmatch(name):
                raise ValueError(f"files: {name!r} is not a plain file name")
        t0 = time.perf_counter()
        if self.cfg.kind == "fs":
            ann = self._publish_fs(version, {k: Path(v) for k, v in files.items()})
        else:
            if len(files) > 1:
                log.info("weights: kafka store ships only %s; not sending %s", MODEL_FILE,
                         sorted(set(files) - {MODEL_FILE}))
            ann = self._publish_kafka(version, Path(files[MODEL_FILE]))
        dt = time.perf_counter() - t0
        log.info("weights: published %s v%d (%d bytes, %s) in %.2fs (%.0f MB/s)", self.run, version, ann.size_bytes,
                 ann.store, dt, ann.size_bytes / 1e6 / max(dt, 1e-9))
        return ann

    def _publish_fs(self, version: int, files: dict[str, Path]) -> wire.WeightsAnnouncement:
        run_dir = Path(self.cfg.root) / self.run
        run_dir.mkdir(parents=True, exist_ok=True)
        final = run_dir / version_dir_name(version)
        tmp = run_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            digest, size = "", 0
            for name, src in files.items():
                hasher = hashlib.sha256()
                with open(src, "rb", buffering=0) as fin, open(tmp / name, "wb", buffering=0) as fout:
                    n = _pump(fin, hasher, fout)
                    os.fsync(fout.fileno())
                if name == MODEL_FILE:
                    digest, size = hasher.hexdigest(), n
            fsync_dir(tmp)
            if final.exists():  # re-publishing a version (learner restarted from a checkpoint): replace it
                _remove_tree(final)
            os.rename(tmp, final)
            fsync_dir(run_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _gc_versions(run_dir, self.cfg.keep, protect=final.name)
        return wire.WeightsAnnouncement(
            run=self.run, version=version, store="fs", location=f"{self.run}/{final.name}/{MODEL_FILE}",
            sha256=digest, size_bytes=size, published_at=wire.now())

    def _publish_kafka(self, version: int, src: Path) -> wire.WeightsAnnouncement:
        topic, key, chunk = self.topics.weight_data.name, f"{self.run}/{version}".encode(), self.cfg.chunk_bytes
        hasher = hashlib.sha256()
        # kafka-python 3 has no buffer_memory bound: cap the unacknowledged chunks ourselves so a 10 GB file
        # never sits in the send queue whole.
        window = max(2, _INFLIGHT_BYTES // chunk)
        pending: deque[FutureRecordMetadata] = deque()
        first: RecordMetadata | None = None
        with open(src, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            num_chunks = max(1, -(-size // chunk))
            for index in range(num_chunks):
                data = _read_exact(f, min(chunk, size - index * chunk), src)
                hasher.update(data)
                record = wire.WeightChunk(run=self.run, version=version, index=index, num_chunks=num_chunks,
                                          data=data)
                pending.append(self.producer.send(topic, key=key, value=wire.encode(record)))
                while len(pending) >= window or (first is None and index == num_chunks - 1):
                    meta = pending.popleft().get(timeout=_SEND_TIMEOUT_S)  # raises the send error, if any
                    first = first or meta
            if f.read(1):
                raise OSError(f"{src}: file grew while it was being published")
        self.producer.flush(timeout=_SEND_TIMEOUT_S)
        for fut in pending:
            fut.get(timeout=_SEND_TIMEOUT_S)
        assert first is not None
        return wire.WeightsAnnouncement(
            run=self.run, version=version, store="kafka", location=f"{topic}:{first.partition}:{first.offset}",
            sha256=hasher.hexdigest(), size_bytes=size, num_chunks=num_chunks, chunk_bytes=chunk,
            published_at=wire.now())

    def announce(self, ann: wire.WeightsAnnouncement) -> None:
        """Send ``ann`` to the weights topic keyed by run and wait for the broker's ack (acks=all)."""
        if ann.run != self.run:
            raise ValueError(f"announcement for run {ann.run!r} from the publisher of run {self.run!r}")
        self.producer.send(self.topics.weights.name, key=self.run.encode(), value=wire.encode(ann)).get(
            timeout=_SEND_TIMEOUT_S)
        log.info("weights: announced %s v%d at %s", ann.run, ann.version, ann.location)

    def close(self) -> None:
        if self._producer is not None and self._owns_producer:
            self._producer.close()
        self._producer = None


def _read_exact(f: BinaryIO, n: int, src: Path) -> bytes:
    data = f.read(n)
    while len(data) < n:  # raw reads may return short; only an empty read means end of file
        more = f.read(n - len(data))
        if not more:
            raise OSError(f"{src}: file shrank while it was being published")
        data += more
    return data


# ------------------------------------------------------------------------------------------ fetching


class WeightFetcher:
    """A producer's side: turn an announcement into the path of a verified local ``model.safetensors``.

    The store is the announcement's (``ann.store``), not ``cfg.kind``: a receiver follows whatever the learner
    announces. ``cfg.root`` resolves relative fs locations; ``cache_dir`` (default ``cfg.root``) holds the
    files reassembled from Kafka.
    """

    def __init__(self, cfg: WeightStoreConfig, kafka: KafkaConfig, cache_dir: Path | None = None,
                 stream: tuple[str, str] | None = None) -> None:
        """``stream=(weight_data_topic, run)`` starts a :class:`ChunkStream` for that run's kafka-store versions."""
        cfg.validate()
        self.cfg, self.kafka = cfg, kafka
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(cfg.root)
        self._consumer: KafkaConsumer | None = None
        self.stream = ChunkStream(kafka, stream[0], stream[1], self.cache_dir) if stream else None

    def fetch(self, ann: wire.WeightsAnnouncement) -> Path:
        """Return the verified file, retrying transient failures with backoff; else raise WeightFetchError."""
        what = f"weights {ann.run!r} v{ann.version} ({ann.store} {ann.location!r})"
        try:
            check_run_name(ann.run)
        except ValueError as exc:
            raise WeightFetchError(f"{what}: {exc}") from None
        attempts = self.cfg.fetch_retries + 1
        for attempt in range(1, attempts + 1):
            t0 = time.perf_counter()
            try:
                path = self._fetch_fs(ann) if ann.store == "fs" else self._fetch_kafka(ann)
            except (_Transient, KafkaError, OSError) as exc:
                reason = str(exc) if isinstance(exc, _Transient) else f"{type(exc).__name__}: {exc}"
                if attempt == attempts:
                    raise WeightFetchError(f"{what}: {reason} (gave up after {attempts} attempts)") from None
                delay = min(self.cfg.fetch_backoff_s * 2 ** (attempt - 1), 10.0)
                log.warning("%s: %s; retry %d/%d in %.2fs", what, reason, attempt, attempts - 1, delay)
                time.sleep(delay)
                continue
            except WeightFetchError as exc:
                raise WeightFetchError(f"{what}: {exc}") from None
            dt = time.perf_counter() - t0
            log.info("%s: verified %s in %.2fs (%.0f MB/s)", what, path, dt, ann.size_bytes / 1e6 / max(dt, 1e-9))
            return path
        raise AssertionError("unreachable")

    # -- fs

    def _fs_path(self, ann: wire.WeightsAnnouncement) -> Path:
        loc = Path(ann.location)
        if loc.is_absolute():
            return loc
        if not ann.location or ".." in loc.parts:
            raise WeightFetchError(f"fs location {ann.location!r}: expected a path inside the store root")
        return Path(self.cfg.root) / loc

    def _fetch_fs(self, ann: wire.WeightsAnnouncement) -> Path:
        path = self._fs_path(ann)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if st.st_size != ann.size_bytes:
                    raise _Transient(f"size mismatch: {path} has {st.st_size} bytes, announced {ann.size_bytes}")
                hasher = hashlib.sha256()
                _pump(f, hasher)
            now = os.stat(path)
        except FileNotFoundError:
            raise _Transient(f"missing: {path} does not exist (garbage-collected, or not yet visible on this "
                             f"volume; weights.root={self.cfg.root!r})") from None
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise _Transient(f"{path} was replaced while it was being verified")
        if hasher.hexdigest() != ann.sha256:
            raise _Transient(f"sha256 mismatch: {path} hashes to {hasher.hexdigest()}, announced {ann.sha256}")
        return path

    # -- kafka

    def cache_path(self, ann: wire.WeightsAnnouncement) -> Path:
        """Where a Kafka-shipped version is reassembled: ``<cache_dir>/<run>/v<version:08d>/model.safetensors``."""
        return self.cache_dir / ann.run / version_dir_name(ann.version) / MODEL_FILE

    def _fetch_kafka(self, ann: wire.WeightsAnnouncement) -> Path:
        dest = self.cache_path(ann)
        if dest.exists():  # cache hit (a restart, a second fetch): verify again, a cache is no proof
            if dest.stat().st_size == ann.size_bytes and sha256_file(dest) == ann.sha256:
                return dest
            log.warning("weights: cached %s does not match the announcement; downloading again", dest)
            dest.unlink(missing_ok=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.stream is not None and self.stream.take(ann, dest):
            _gc_versions(dest.parent.parent, self.cfg.keep, protect=dest.parent.name)
            return dest
        starts = self._start_offsets(ann)
        tmp = dest.parent.parent / f".tmp-{dest.parent.name}-{uuid.uuid4().hex[:8]}.part"
        try:
            with (open(tmp, "wb", buffering=0) as out,
                  _Assembler(ann.run, ann.version, ann.num_chunks, out, max_bytes=ann.size_bytes) as assembler):
                self._read_chunks(ann, starts, assembler)
                assembler.verify(ann)
            os.replace(tmp, dest)  # concurrent fetchers sharing the cache each replace with identical bytes
        finally:
            tmp.unlink(missing_ok=True)
        _gc_versions(dest.parent.parent, self.cfg.keep, protect=dest.parent.name)
        return dest

    def _kafka_consumer(self) -> KafkaConsumer:
        """One group-less consumer, reused across fetches (reconnecting per version costs more than a chunk)."""
        if self._consumer is None:
            self._consumer = _chunk_consumer(self.kafka, "weights-fetch")
        return self._consumer

    def _start_offsets(self, ann: wire.WeightsAnnouncement) -> dict[TopicPartition, int]:
        """Where to start reading: chunk 0's offset from the location, else a timestamp lookup."""
        try:
            topic, partition, offset = _parse_kafka_location(ann.location)
        except ValueError as exc:
            raise WeightFetchError(str(exc)) from None
        consumer = self._kafka_consumer()
        if partition is not None and offset is not None:
            tp = TopicPartition(topic, partition)
            begin = consumer.beginning_offsets([tp])[tp]
            if offset < begin:
                raise WeightFetchError(
                    f"chunks deleted by retention: chunk 0 was at offset {offset}, {topic}[{partition}] now starts at "
                    f"{begin}; raise topics.weight_data.retention_ms or have the learner publish again")
            return {tp: offset}
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise _Transient(f"weight-data topic {topic!r} not found")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        since_ms = int(max(0.0, ann.published_at - _FALLBACK_LOOKBACK_S) * 1000)
        found = consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = consumer.end_offsets(tps)
        return {tp: (found[tp].offset if found.get(tp) else ends[tp]) for tp in tps}

    def _read_chunks(self, ann: wire.WeightsAnnouncement, starts: dict[TopicPartition, int],
                     assembler: _Assembler) -> None:
        """Feed the assembler this version's chunks until it is complete. The end offsets are taken first:
        the publisher flushed every chunk before announcing, so reaching them with chunks missing is final."""
        consumer = self._kafka_consumer()
        tps = list(starts)
        consumer.assign(tps)
        for tp, offset in starts.items():
            consumer.seek(tp, offset)
        ends = consumer.end_offsets(tps)
        key = f"{ann.run}/{ann.version}".encode()
        stall_deadline = time.monotonic() + _STALL_S
        while not assembler.complete:
            if all(consumer.position(tp) >= ends[tp] for tp in tps):
                raise WeightFetchError(f"incomplete: {assembler.next_index} of {ann.num_chunks} chunks found up to "
                                       f"the end of {sorted(map(str, tps))} (deleted by retention?)")
            batches = consumer.poll(timeout_ms=500)
            if not batches:
                if time.monotonic() > stall_deadline:
                    raise _Transient(f"no chunk data from the broker for {_STALL_S:.0f}s")
                continue
            stall_deadline = time.monotonic() + _STALL_S
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


def _chunk_consumer(kafka: KafkaConfig, role: str) -> KafkaConsumer:
    """A group-less consumer whose fetches hold several multi-MiB chunk records."""
    fetch_bytes = max(kafka.max_record_bytes, 48 * MiB)
    return make_consumer(kafka, role, None, max_partition_fetch_bytes=fetch_bytes, fetch_max_bytes=fetch_bytes)


class _ChunkWriter:
    """Writes chunks to ``out`` and hashes them, in order, on two threads of its own: the disk write and the
    sha256 (both release the GIL) of earlier chunks overlap each other and the receive and decode of the next
    chunk. At most ``depth`` chunks wait in memory per thread."""

    def __init__(self, out: BinaryIO, depth: int = 4) -> None:
        self.out, self.hasher, self.error = out, hashlib.sha256(), cast(OSError | None, None)
        self._queues: list[queue.Queue[bytes | None]] = [queue.Queue(maxsize=depth), queue.Queue(maxsize=depth)]
        self._threads = [threading.Thread(target=self._write, name="weights-writer", daemon=True),
                         threading.Thread(target=self._hash, name="weights-hasher", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _write(self) -> None:
        while (data := self._queues[0].get()) is not None:
            if self.error is None:  # after a failed write, drain the queue so put() never blocks forever
                try:
                    _write_all(self.out, data)
                except OSError as exc:
                    self.error = exc

    def _hash(self) -> None:
        while (data := self._queues[1].get()) is not None:
            self.hasher.update(data)

    def put(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        for q in self._queues:
            q.put(data)

    def close(self) -> None:
        """Wait until everything queued is written (or dropped after an error) and hashed; idempotent."""
        for q, thread in zip(self._queues, self._threads, strict=True):
            if thread.is_alive():
                q.put(None)
                thread.join()

    def finish(self) -> str:
        """The sha256 of everything written; raises the write error, if there was one."""
        self.close()
        if self.error is not None:
            raise self.error
        return self.hasher.hexdigest()


class _Assembler:
    """Writes one version's chunks in index order to ``out``, hashing as it goes (no second pass).

    A chunk 0 after progress restarts the assembly (an earlier, abandoned publication of the same version seen by
    a timestamp scan, or a learner re-publishing after a crash); older indices are duplicates and skipped; a jump
    forward means chunks are missing. ``max_bytes`` (the announced size, when known) caps what is written. The
    write and hash run on :class:`_ChunkWriter` threads: use the assembler as a context manager (or call
    :meth:`close`) so they end, and :meth:`finish` / :meth:`verify` for the result.
    """

    def __init__(self, run: str, version: int, num_chunks: int, out: BinaryIO, max_bytes: int | None = None) -> None:
        self.run, self.version, self.num_chunks, self.out, self.max_bytes = run, version, num_chunks, out, max_bytes
        self.writer: _ChunkWriter | None = None
        self._reset()

    def __enter__(self) -> _Assembler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reset(self) -> None:
        self.close()
        self.out.seek(0)  # overwritten from the start, cut to size by finish(): ``out`` may be a pre-filled spare
        self.next_index, self.size, self.writer = 0, 0, _ChunkWriter(self.out)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def complete(self) -> bool:
        return self.next_index == self.num_chunks

    def add(self, msg: ConsumerRecord) -> None:
        self.add_chunk(decode_chunk(msg), f"{msg.topic}[{msg.partition}]@{msg.offset}")

    def add_chunk(self, chunk: wire.WeightChunk, where: str) -> None:
        if (chunk.run, chunk.version) != (self.run, self.version):
            raise WeightFetchError(f"chunk at {where} is {chunk.run!r} v{chunk.version}, keyed as this version")
        if chunk.num_chunks != self.num_chunks:
            log.warning("weights: skipping chunk at %s: part of a %d-chunk publication, expected %d", where,
                        chunk.num_chunks, self.num_chunks)
            return
        if chunk.index == 0 and self.next_index > 0:
            self._reset()
        if chunk.index < self.next_index:
            return
        if chunk.index > self.next_index:
            raise WeightFetchError(f"chunk {chunk.index} at {where} follows chunk {self.next_index - 1}: "
                                   f"chunks {self.next_index}..{chunk.index - 1} are missing")
        if self.max_bytes is not None and self.size + len(chunk.data) > self.max_bytes:
            raise WeightFetchError(f"chunks add up to more than the announced {self.max_bytes} bytes")
        assert self.writer is not None
        self.writer.put(chunk.data)
        self.size += len(chunk.data)
        self.next_index += 1

    def finish(self) -> str:
        """Wait for the writes and cut ``out`` to what was written; the sha256 of what was assembled."""
        assert self.writer is not None
        digest = self.writer.finish()
        self.out.truncate(self.size)
        return digest

    def verify(self, ann: wire.WeightsAnnouncement) -> None:
        """Kafka records are immutable and CRC-checked: a mismatch here will not heal by retrying."""
        digest = self.finish()
        if self.size != ann.size_bytes:
            raise WeightFetchError(f"size mismatch: reassembled {self.size} bytes, announced {ann.size_bytes}")
        if digest != ann.sha256:
            raise WeightFetchError(f"sha256 mismatch: reassembled file hashes to {digest}, announced {ann.sha256}")


def decode_chunk(msg: ConsumerRecord) -> wire.WeightChunk:
    try:
        return wire.decode(msg.value, wire.WeightChunk)
    except wire.WireError as exc:
        raise WeightFetchError(f"undecodable chunk at {msg.topic}[{msg.partition}]@{msg.offset}: {exc}") from None


# ------------------------------------------------------------------------------------------ streaming


@dataclass
class _Streamed:
    """A version the stream has assembled (or is assembling): where chunk 0 was, the file, what it hashes to."""

    version: int
    partition: int
    first_offset: int
    path: Path
    size: int = 0
    sha256: str = ""


class _Spare:
    """A file of zeros the stream writes ahead of the next version, so that the version's bytes overwrite pages
    already in the page cache instead of allocating them while the upload is running (measured here: overwriting
    1 GB costs 0.1-0.3 s of kernel time during an upload, writing it afresh 0.3-2 s). Filled on a thread of its
    own between versions; :meth:`take` stops the filling wherever it got to. Only ever a head start: a short,
    failed or vanished spare just means more fresh pages."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size, self._stop = path, size, threading.Event()
        self._thread = threading.Thread(target=self._fill, name="weights-spare", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        zeros = memoryview(bytes(_IO_BYTES))
        try:
            with open(self.path, "wb", buffering=0) as f:
                done = 0
                while done < self.size and not self._stop.is_set():
                    done += f.write(zeros[:min(_IO_BYTES, self.size - done)])
        except OSError as exc:
            log.warning("weights stream: spare file %s: %s (the next version is written afresh)", self.path, exc)

    def take(self) -> Path:
        """Stop filling; the file is the caller's now (it may be short, or missing if the fill failed)."""
        self._stop.set()
        self._thread.join()
        return self.path

    def discard(self) -> None:
        self.take().unlink(missing_ok=True)


class ChunkStream:
    """Assembles a run's kafka-store versions *while the learner publishes them*, on a background thread.

    Without it a producer starts reading a version's chunks when the announcement arrives, i.e. after the whole
    upload, and the swap takes as long as a full download. The stream tails the weight-data topic from the
    moment it starts; when an announcement arrives, :meth:`take` only waits for the last chunks and checks the
    size and sha256 the stream computed while writing. It keeps one version in progress (a newer chunk 0
    abandons an older partial) and one finished version; anything it cannot vouch for (a version whose chunk 0
    came before the stream started, a stall, a mismatch, a broken stream) makes :meth:`take` return False and
    the fetcher downloads the version itself. Costs: one consumer thread (plus a writer and a hasher thread
    while a version is in progress), a copy of every version on disk, and between versions a :class:`_Spare`
    of the last version's size.
    """

    def __init__(self, kafka: KafkaConfig, topic: str, run: str, cache_dir: Path) -> None:
        self.run, self.prefix, self.dir = check_run_name(run), f"{run}/".encode(), Path(cache_dir) / run
        self.consumer = _chunk_consumer(kafka, "weights-stream")
        parts = with_retry(lambda: require_partitions(self.consumer, topic), f"weights stream: metadata of {topic}")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        self.start = {tp.partition: self.consumer.position(tp) for tp in tps}  # everything from here is seen
        self.positions = dict(self.start)
        self.current: tuple[_Streamed, _Assembler] | None = None  # the assembler's ``out`` is the open file
        self.done: _Streamed | None = None
        self.spare: _Spare | None = None  # prepared after each version, sized like it, for the next one
        self.hits, self.spares_used, self.failed, self._stop = 0, 0, "", False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="weights-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop:
                for tp, msgs in self.consumer.poll(timeout_ms=200).items():
                    for msg in msgs:
                        if msg.key is not None and msg.key.startswith(self.prefix):
                            self._feed(msg)
                    with self.cond:
                        self.positions[tp.partition] = msgs[-1].offset + 1
                        self.cond.notify_all()
        except Exception as exc:  # the fetcher falls back to downloading; a broken stream must not stop a producer
            log.warning("weights stream stopped (fetches download whole versions from now on): %s", exc)
            with self.cond:
                self.failed = f"{type(exc).__name__}: {exc}"
                self.cond.notify_all()

    def _feed(self, msg: ConsumerRecord) -> None:
        try:
            version = int(msg.key[len(self.prefix):])
        except ValueError:
            return
        where = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        current = self.current
        if current is not None and version < current[0].version:
            return
        try:
            chunk = decode_chunk(msg)
            if current is None or version > current[0].version or chunk.index == 0:  # chunk 0: (re)start
                if chunk.index != 0:
                    return  # joined in the middle of this publication: the fetcher downloads it
                current = self._begin(version, msg, chunk.num_chunks)
            streamed, assembler = current
            assembler.add_chunk(chunk, where)
            if not assembler.complete:
                return
            streamed.size, streamed.sha256 = assembler.size, assembler.finish()
        except (WeightFetchError, OSError) as exc:  # this version only: the fetcher downloads it instead
            log.warning("weights stream: dropping v%d: %s", version, exc)
            self._abandon()
            return
        assembler.out.close()
        # Before the version is handed over, so that whoever takes it finds the next one's spare under way.
        self.spare = _Spare(self.dir / f".stream-spare-{uuid.uuid4().hex[:8]}.part", streamed.size)
        with self.cond:
            if self.done is not None:
                self.done.path.unlink(missing_ok=True)
            self.done, self.current = streamed, None
            self.cond.notify_all()

    def _begin(self, version: int, msg: ConsumerRecord, num_chunks: int) -> tuple[_Streamed, _Assembler]:
        self._abandon()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f".stream-{version_dir_name(version)}-{uuid.uuid4().hex[:8]}.part"
        out: BinaryIO | None = None
        if self.spare is not None:
            spare, self.spare = self.spare.take(), None
            with contextlib.suppress(OSError):  # gone (a GC sweep, a failed fill): start afresh
                os.rename(spare, path)
                out = open(path, "r+b", buffering=0)  # noqa: SIM115 -- closed when complete or abandoned
                self.spares_used += 1
        if out is None:
            out = open(path, "wb", buffering=0)  # noqa: SIM115 -- closed when complete or abandoned
        streamed = _Streamed(version, msg.partition, msg.offset, path)
        self.current = (streamed, _Assembler(self.run, version, num_chunks, out))
        return self.current

    def _abandon(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current[1].out.close()
            self.current[0].path.unlink(missing_ok=True)
            self.current = None

    def take(self, ann: wire.WeightsAnnouncement, dest: Path) -> bool:
        """Move the announced version to ``dest`` if the stream assembled exactly it; False: download it."""
        try:
            _, partition, offset = _parse_kafka_location(ann.location)
        except ValueError:
            return False
        if partition is None or offset is None or offset < self.start.get(partition, offset + 1):
            return False
        found = self._wait_for(ann.version, partition, offset)
        if found is None:
            return False
        if (found.size, found.sha256) != (ann.size_bytes, ann.sha256):
            log.warning("weights stream: v%d does not match its announcement; downloading it", ann.version)
            found.path.unlink(missing_ok=True)
            return False
        os.replace(found.path, dest)
        self.hits += 1
        return True

    def _wait_for(self, version: int, partition: int, offset: int) -> _Streamed | None:
        """The finished version whose chunk 0 was at ``offset``, waiting while the stream still makes progress."""
        with self.cond:
            seen, stall_at = self.positions[partition], time.monotonic() + _STALL_S
            while True:
                done, current = self.done, self.current
                if done is not None and (done.version, done.partition, done.first_offset) == (
                        version, partition, offset):
                    self.done = None
                    return done
                on_it = current is not None and (current[0].version, current[0].first_offset) == (version, offset)
                if self.failed or self._stop or (self.positions[partition] > offset and not on_it):
                    return None
                if self.positions[partition] != seen:
                    seen, stall_at = self.positions[partition], time.monotonic() + _STALL_S
                elif time.monotonic() > stall_at:
                    return None
                self.cond.wait(0.2)

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=10)
        self.consumer.close()
        self._abandon()
        if self.spare is not None:
            self.spare.discard()
        if self.done is not None:
            self.done.path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ catching up


def latest_announcement(kafka: KafkaConfig, topic: str, run: str,
                        timeout_s: float = 30.0) -> wire.WeightsAnnouncement | None:
    """The current announcement for ``run``: read the compacted weights topic from the beginning to the end
    offsets taken at the start and return the *last valid record written* for the run (None if there is none,
    or if the last word is a tombstone). In normal operation that is the highest version; after a learner
    rewound to a checkpoint and re-published, it is the re-published one -- the same answer compaction will
    eventually leave, so a new producer's view does not depend on when the log cleaner last ran. Undecodable or
    mis-keyed records are skipped with a warning. Raises WeightFetchError if the topic is missing or the end is
    not reached within ``timeout_s``."""
    consumer = make_consumer(kafka, "weights-catchup", None)
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise WeightFetchError(f"weights topic {topic!r} not found (run `grpo-stream topics create`)")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        key, latest = run.encode(), None
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise WeightFetchError(f"weights topic {topic!r}: end not reached within {timeout_s:.0f}s")
            for msgs in consumer.poll(timeout_ms=200).values():
                for msg in msgs:
                    if msg.key == key and msg.offset < ends[TopicPartition(msg.topic, msg.partition)]:
                        latest = _apply_announcement(msg, run, latest)
        return latest
    finally:
        consumer.close()


def _apply_announcement(msg: ConsumerRecord, run: str,
                        latest: wire.WeightsAnnouncement | None) -> wire.WeightsAnnouncement | None:
    if msg.value is None:  # tombstone: the run's announcements were deleted
        return None
    where = f"{msg.topic}[{msg.partition}]@{msg.offset}"
    try:
        ann = wire.decode(msg.value, wire.WeightsAnnouncement)
    except wire.WireError as exc:
        log.warning("weights: skipping bad record at %s: %s", where, exc)
        return latest
    if ann.run != run:
        log.warning("weights: skipping record at %s: keyed %r but announces run %r", where, run, ann.run)
        return latest
    return ann
