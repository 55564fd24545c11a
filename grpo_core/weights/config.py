"""The weight store's config: which store the learner publishes to, and each store's own settings.

A receiver follows whatever store an announcement names (``ann.store``), so a producer's ``kind`` only says
which store it expects; both stores' sections are read by whoever needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_core.config import KafkaConfig, TopicSpec, opt, require
from grpo_core.weights.common import CHUNK_OVERHEAD_BYTES, MiB

StoreKind = Literal["fs", "kafka"]


@dataclass
class FsStoreConfig:
    """``fs``: a directory shared by the learner and the producers (NFS, a k8s RWX volume, one host's disk)."""

    root: str = opt(".cache/weights", "The shared directory. Each role may mount it at its own path: announced "
                                      "locations are relative to it.")
    keep: int = opt(3, "Versions kept in the shared directory (the newest; never the one just published).")

    def validate(self) -> None:
        require(bool(self.root), "weights.fs.root: must not be empty")
        require(self.keep >= 1, f"weights.fs.keep: must be >= 1 (got {self.keep}); 2+ gives slow producers slack")


@dataclass
class KafkaStoreConfig:
    """``kafka``: weight bytes as chunk records on the weight-data topic, for deployments without shared storage."""

    chunk_bytes: int = opt(
        8 * MiB, "Learner: bytes of weights per chunk record; chunk_bytes + 64 KiB must fit kafka.max_record_bytes "
                 "and the weight_data topic's max_message_bytes.")
    cache_dir: str = opt(".cache/weights-cache", "Receivers: where versions reassembled from Kafka are kept.")
    cache_keep: int = opt(3, "Receivers: versions kept in cache_dir (the newest).")
    stream: bool = opt(
        True, "Receivers: assemble each version's chunks while the learner publishes it (a background consumer), "
              "so a swap waits only for the last chunks after the announcement instead of a full download. "
              "Costs a consumer thread and, between versions, a spare file of one version's size in cache_dir.")

    def validate(self) -> None:
        require(bool(self.cache_dir), "weights.kafka.cache_dir: must not be empty")
        require(self.cache_keep >= 1, f"weights.kafka.cache_keep: must be >= 1 (got {self.cache_keep})")
        require(64 * 1024 <= self.chunk_bytes <= 1 << 30, f"weights.kafka.chunk_bytes: {self.chunk_bytes} not in "
                f"[64 KiB, 1 GiB]; the default 8 MiB is a good choice")

    def check_fits(self, kafka: KafkaConfig, spec: TopicSpec) -> None:
        """A chunk record must fit both the client's and the topic's record limit."""
        limit = min(kafka.max_record_bytes, spec.max_message_bytes)
        require(self.chunk_bytes + CHUNK_OVERHEAD_BYTES <= limit,
                f"weights.kafka.chunk_bytes: {self.chunk_bytes} + {CHUNK_OVERHEAD_BYTES} bytes of record overhead "
                f"exceeds {limit} (min of kafka.max_record_bytes={kafka.max_record_bytes} and the weight_data "
                f"topic's max_message_bytes={spec.max_message_bytes}); set weights.kafka.chunk_bytes <= "
                f"{limit - CHUNK_OVERHEAD_BYTES} or raise both limits")


@dataclass
class WeightStoreConfig:
    """Where published weights live and how receivers fetch them (layouts: :mod:`grpo_core.weights`)."""

    kind: StoreKind = opt("fs", "The store the learner publishes to: fs (shared directory) or kafka (chunk records).")
    fs: FsStoreConfig = opt(factory=FsStoreConfig, help="The fs store.")
    kafka: KafkaStoreConfig = opt(factory=KafkaStoreConfig, help="The kafka store.")
    fetch_retries: int = opt(5, "Receivers: retries of a failed fetch (missing/corrupt file, broker error).")
    fetch_backoff_s: float = opt(0.5, "Receivers: first retry delay; doubles per retry, capped at 10 s.")

    def validate(self) -> None:
        require(self.fetch_retries >= 0, f"weights.fetch_retries: must be >= 0 (got {self.fetch_retries})")
        require(self.fetch_backoff_s >= 0, f"weights.fetch_backoff_s: must be >= 0 (got {self.fetch_backoff_s})")
