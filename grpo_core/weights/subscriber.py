"""The producer's weight subscription: follow the learner's announcements, fetch and verify newer weights,
and hand them to the backend: between batches, or under the requests in flight (the producer's ``weights.swap``;
a completion then records which version sampled which tokens).

A weight file that is missing or corrupt is retried by the fetcher with backoff; if it still fails, the failure
is reported and the producer keeps generating with the weights it has, trying again after ``retry_after_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_core import wire
from grpo_core.kafka_io import Consumer, Partition, poll, require_partitions, with_retry
from grpo_core.weights import WeightFetcher, WeightFetchError

log = logging.getLogger(__name__)


@dataclass
class Swap:
    """A completed hot-swap: the new version, when the learner announced it, how long the fetch+load took."""

    version: int
    announced_at: float
    load_s: float


class WeightSubscriber:
    def __init__(self, consumer: Consumer, topic: str, run: str, fetcher: WeightFetcher, version: int,
                 retry_after_s: float = 5.0, contract: str = "") -> None:
        """``contract``: this producer's pipeline-contract digest; announcements from a learner with another
        contract are refused (never loaded) and reported in :attr:`refused`."""
        self.consumer, self.topic, self.run, self.fetcher = consumer, topic, run, fetcher
        self.contract, self.refused = contract, ""
        self.version = version
        self.newest: wire.WeightsAnnouncement | None = None
        self.retry_after_s = retry_after_s
        self._failed_at: dict[int, float] = {}
        parts = with_retry(lambda: require_partitions(consumer, topic), f"producer: metadata of {topic}")
        tps = [Partition(topic, p) for p in parts]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)  # compacted: the latest announcement per run is always retained

    def catch_up(self, timeout_s: float) -> None:
        """Read the topic up to the end offsets of now, so :attr:`newest` is the run's current announcement before
        anything is generated (a restarted producer must not sample with its initial weights while the learner is
        far ahead). Raises WeightFetchError when the end is not reached within ``timeout_s``."""
        tps = list(self.consumer.assignment())
        ends = with_retry(lambda: self.consumer.end_offsets(tps), f"producer: end offsets of {self.topic}")
        deadline = time.monotonic() + timeout_s
        while any(self.consumer.position(tp) < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                raise WeightFetchError(f"weights topic {self.topic!r}: its end was not reached within "
                                       f"{timeout_s:.0f}s (is the broker reachable? weights_catchup_s)")
            self.poll(timeout_ms=200)
        log.info("weights: caught up on %s; newest announced v%d (ours v%d)", self.topic, self.newest_version,
                 self.version)

    @property
    def newest_version(self) -> int:
        return self.newest.version if self.newest is not None else self.version

    def poll(self, timeout_ms: int = 0) -> None:
        """Read new announcements (non-blocking by default); remember the newest one for our run."""
        for msgs in poll(self.consumer, timeout_ms).values():
            for msg in msgs:
                try:
                    ann = wire.decode(msg.value, wire.WeightsAnnouncement)
                except wire.WireError as exc:
                    log.warning("ignoring a bad record on %s@%d: %s", self.topic, msg.offset, exc)
                    continue
                # The last valid record for the run wins (what compaction keeps), also after a learner rewind.
                if ann.run == self.run:
                    self._consider(ann)

    def _consider(self, ann: wire.WeightsAnnouncement) -> None:
        if ann.contract and self.contract and ann.contract != self.contract:
            self.refused = (f"weights v{ann.version} refused: the learner's pipeline contract is {ann.contract}, "
                            f"this producer's {self.contract}; give every role the same pipeline section")
            log.error("%s", self.refused)
            return
        self.newest, self.refused = ann, ""

    def maybe_swap(self, load: Callable[[Path], None]) -> Swap | None:
        """If a version other than ours was announced, fetch it and ``load(model_dir)``; None if there is nothing
        to do. A failed fetch raises WeightFetchError (the caller reports it and keeps its weights); that
        version is not tried again for ``retry_after_s``."""
        ann = self.newest
        if ann is None or ann.version == self.version:
            return None
        failed = self._failed_at.get(ann.version)
        if failed is not None and time.monotonic() - failed < self.retry_after_s:
            return None
        t0 = time.perf_counter()
        try:
            path = self.fetcher.fetch(ann)
        except WeightFetchError as exc:
            self._failed_at[ann.version] = time.monotonic()
            log.error("weights v%d unavailable, generating with v%d meanwhile: %s", ann.version, self.version, exc)
            raise
        load(path.parent)
        self.version = ann.version
        self._failed_at.pop(ann.version, None)
        return Swap(ann.version, ann.published_at, time.perf_counter() - t0)
