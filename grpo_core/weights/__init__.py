"""Policy weights: how the learner publishes a version and how producers fetch it.

Weight bytes never travel in a :class:`~grpo_core.wire.WeightsAnnouncement`; the announcement names the store,
the location and the sha256. A store is one small class per backend (:class:`WeightStore`): ``fs``
(:mod:`.fs`, a shared directory) and ``kafka`` (:mod:`.kafka`, chunk records, with the receivers' chunk stream in
:mod:`.stream`). :data:`STORES` is the one place a store kind becomes a class. Announcements and the catch-up on
the latest one are in :mod:`.announcements`; the producer's subscription (follow announcements, fetch, hand
over) in :mod:`.subscriber`.

Every fetch failure surfaces as one exception type, :class:`WeightFetchError`, after the retries that make
sense: a missing/corrupt file on a shared volume and broker errors are retried with exponential backoff
(``fetch_retries``, ``fetch_backoff_s``, through :func:`grpo_core.retry.retry`); facts that retrying cannot
change (Kafka records are immutable, so a reassembled file with the wrong sha256 stays wrong; chunks deleted by
retention stay deleted) fail at once. Unverified bytes are never returned.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import BrokerError, Producer, make_producer
from grpo_core.retry import retry
from grpo_core.weights.announcements import announce, latest_announcement, read_announcements
from grpo_core.weights.common import (
    MODEL_FILE,
    NAME_RE,
    Transient,
    WeightFetchError,
    check_run_name,
    sha256_file,
    version_dir_name,
)
from grpo_core.weights.config import FsStoreConfig, KafkaStoreConfig, StoreKind, WeightStoreConfig
from grpo_core.weights.fs import FsStore
from grpo_core.weights.kafka import KafkaStore
from grpo_core.weights.payload import Payload
from grpo_core.weights.stream import ChunkStream

__all__ = ["MODEL_FILE", "STORES", "ChunkStream", "FsStoreConfig", "KafkaStoreConfig", "Payload", "WeightFetchError",
           "WeightFetcher", "WeightPublisher", "WeightStore", "WeightStoreConfig", "announce", "check_run_name",
           "latest_announcement", "read_announcements", "sha256_file", "version_dir_name"]

log = logging.getLogger("grpo_core.weights")


class WeightStore(Protocol):
    """One backend: write a version (learner), verify/fetch one (receivers), prune old versions."""

    kind: str

    def publish(self, run: str, version: int, files: Mapping[str, Path | Payload]) -> wire.WeightsAnnouncement: ...
    def fetch(self, ann: wire.WeightsAnnouncement) -> Path: ...
    def gc(self, run: str, protect: str) -> list[str]: ...
    def close(self) -> None: ...


def _fs(cfg: WeightStoreConfig, kafka: KafkaConfig, weight_data_topic: str, **_: Any) -> WeightStore:
    return FsStore(cfg.fs)


def _kafka(cfg: WeightStoreConfig, kafka: KafkaConfig, weight_data_topic: str, *, stream_run: str | None = None,
           producer: Callable[[], Producer] | None = None) -> WeightStore:
    stream = (ChunkStream(kafka, weight_data_topic, stream_run, Path(cfg.kafka.cache_dir))
              if stream_run is not None and cfg.kafka.stream else None)
    return KafkaStore(cfg.kafka, kafka, weight_data_topic, stream=stream, producer=producer)


STORES: dict[StoreKind, Any] = {"fs": _fs, "kafka": _kafka}


PUBLISH_ATTEMPTS = 30  # uploads of one version through a broker outage (each fails after the delivery timeout)


class WeightPublisher:
    """The learner's side: write a version to the store of ``cfg.kind``, then announce it.

    ``publish`` and ``announce`` are separate so the learner can checkpoint in between (an announced version
    must always be restorable). Send failures propagate as broker errors; file errors as ``OSError``.
    """

    def __init__(self, cfg: WeightStoreConfig, kafka: KafkaConfig, weights_topic: str, weight_data_topic: str,
                 run: str, contract: str = "", producer: Producer | None = None) -> None:
        self.cfg, self.kafka, self.run, self.contract = cfg, kafka, check_run_name(run), contract
        self.weights_topic = weights_topic
        self._producer, self._owns_producer = producer, producer is None
        # One producer for the chunks and the announcements, created on first use.
        self.store: WeightStore = STORES[cfg.kind](cfg, kafka, weight_data_topic, producer=lambda: self.producer)

    @property
    def producer(self) -> Producer:
        """Created on first use: an fs publisher that never announces (tests, tools) needs no broker."""
        if self._producer is None:
            # No linger: an announcement is awaited at once (5 ms of the learner's step at every publish) and a
            # chunk fills a batch alone, so waiting for records to batch with only delays them.
            self._producer = make_producer(self.kafka, "weights", compression_type=None, linger_ms=0)
        return self._producer

    def publish(self, version: int,
                files: Mapping[str, str | os.PathLike[str] | Payload]) -> wire.WeightsAnnouncement:
        """Store ``files`` (name -> source path or :class:`Payload`; ``model.safetensors`` required, e.g.
        ``config.json`` optional) as ``version`` and return the announcement to pass to :meth:`announce`."""
        if version < 0:
            raise ValueError(f"version: {version} < 0")
        if MODEL_FILE not in files:
            raise ValueError(f"files: {MODEL_FILE!r} is required, got {sorted(files)}")
        for name in files:
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"files: {name!r} is not a plain file name")
        t0 = time.perf_counter()
        paths = {k: v if isinstance(v, Payload) else Path(v) for k, v in files.items()}
        # Through a broker outage longer than the client's delivery timeout the kafka store's upload fails; a
        # whole new upload is safe (receivers restart a version's assembly at its chunk 0), so wait and redo it.
        ann = retry(lambda: self.store.publish(self.run, version, paths), f"weights: publish v{version}",
                    attempts=PUBLISH_ATTEMPTS, backoff_s=2.0, transient=(BrokerError,))
        ann.contract = self.contract
        dt = time.perf_counter() - t0
        log.info("weights: published %s v%d (%d bytes, %s) in %.2fs (%.0f MB/s)", self.run, version, ann.size_bytes,
                 ann.store, dt, ann.size_bytes / 1e6 / max(dt, 1e-9))
        return ann

    def announce(self, ann: wire.WeightsAnnouncement) -> None:
        if ann.run != self.run:
            raise ValueError(f"announcement for run {ann.run!r} from the publisher of run {self.run!r}")
        announce(self.producer, self.weights_topic, ann)

    def close(self) -> None:
        self.store.close()
        if self._producer is not None and self._owns_producer:
            self._producer.close()
        self._producer = None


class WeightFetcher:
    """A receiver's side: turn an announcement into the path of a verified local ``model.safetensors``.

    The store is the announcement's (``ann.store``), not ``cfg.kind``: a receiver follows whatever the learner
    announces. ``stream_run`` starts a :class:`ChunkStream` for that run's kafka-store versions.
    """

    def __init__(self, cfg: WeightStoreConfig, kafka: KafkaConfig, weight_data_topic: str,
                 stream_run: str | None = None) -> None:
        self.cfg = cfg
        self.stores: dict[str, WeightStore] = {
            kind: make(cfg, kafka, weight_data_topic, stream_run=stream_run) for kind, make in STORES.items()}

    @property
    def stream(self) -> ChunkStream | None:
        return getattr(self.stores["kafka"], "stream", None)

    def fetch(self, ann: wire.WeightsAnnouncement, superseded: Callable[[], bool] | None = None) -> Path:
        """Return the verified file, retrying transient failures with backoff; else raise WeightFetchError.
        ``superseded``: True once a newer version is announced; retrying this one then stops at once (the newest
        good version is worth more than an old one that may never come)."""
        what = f"weights {ann.run!r} v{ann.version} ({ann.store} {ann.location!r})"
        try:
            check_run_name(ann.run)
        except ValueError as exc:
            raise WeightFetchError(f"{what}: {exc}") from None
        attempts = self.cfg.fetch_retries + 1
        t0 = time.perf_counter()
        try:
            path = retry(lambda: self.stores[ann.store].fetch(ann), what, attempts=attempts,
                         backoff_s=self.cfg.fetch_backoff_s, transient=(Transient, BrokerError, OSError),
                         give_up=superseded)
        except (Transient, BrokerError, OSError) as exc:
            reason = str(exc) if isinstance(exc, Transient) else f"{type(exc).__name__}: {exc}"
            why = "a newer version was announced" if superseded is not None and superseded() \
                else f"gave up after {attempts} attempts"
            raise WeightFetchError(f"{what}: {reason} ({why})") from None
        except WeightFetchError as exc:
            raise WeightFetchError(f"{what}: {exc}") from None
        dt = time.perf_counter() - t0
        log.info("%s: verified %s in %.2fs (%.0f MB/s)", what, path, dt, ann.size_bytes / 1e6 / max(dt, 1e-9))
        return path

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
