"""The producer's weight subscription: follow the learner's announcements, fetch and verify newer weights,
and hand them to the backend: between batches, or under the requests in flight (the producer's ``weights.swap``;
a completion then records which version sampled which tokens).

The newest good version wins: a version is retried (by the fetcher, with backoff) only while nothing newer is
announced; a refused, corrupt or vanished version is skipped for the newest one at once. If the newest fails, the
failure is reported and the producer keeps generating with the weights it has, trying again after
``retry_after_s``. :class:`LagWatch` tells /health when the producer has been too far behind for too long.

A version's identity is (version, incarnation): a learner restarted from a checkpoint older than versions it
announced announces those numbers again, with other weights, under a higher incarnation (``grpo_learner.saving``).
The same version under another incarnation is loaded, unless its sha256 is the one we loaded (the same bytes: the
new incarnation is adopted without a reload). Logs name a version as ``v12@i1``.
"""

from __future__ import annotations

import functools
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
    incarnation: int = 0


def label(version: int, incarnation: int) -> str:
    """How logs name a version: ``v12@i1`` (version 12 as the learner's incarnation 1 announced it)."""
    return f"v{version}@i{incarnation}"


class WeightSubscriber:
    def __init__(self, consumer: Consumer, topic: str, run: str, fetcher: WeightFetcher, version: int,
                 retry_after_s: float = 5.0, contract: str = "", lag: LagWatch | None = None) -> None:
        """``contract``: this producer's pipeline-contract digest; announcements from a learner with another
        contract are refused (never loaded) and reported in :attr:`refused`. ``lag``: how far behind is too far
        (default: never unhealthy)."""
        self.consumer, self.topic, self.run, self.fetcher = consumer, topic, run, fetcher
        self.contract, self.refused = contract, ""
        self.version, self.sha256 = version, ""  # sha256: of the announced file we loaded ("" for initial weights)
        self.incarnation = 0  # the incarnation of the learner that announced what we loaded (0: initial weights)
        self.skipped = 0  # versions passed over for a newer one
        self.lag = lag or LagWatch(-1, 0.0)
        self.newest: wire.WeightsAnnouncement | None = None
        self.retry_after_s = retry_after_s
        self._failed_at: dict[tuple[int, int, str], float] = {}  # by (version, incarnation, sha256)
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
        log.info("weights: caught up on %s; newest announced %s (ours %s)", self.topic, self._newest_label(),
                 label(self.version, self.incarnation))

    @property
    def newest_version(self) -> int:
        return self.newest.version if self.newest is not None else self.version

    def _newest_label(self) -> str:
        n = self.newest
        return label(n.version, n.incarnation) if n is not None else label(self.version, self.incarnation)

    @property
    def outdated(self) -> bool:
        """Whether the newest announcement names weights other than ours (a newer version, or the same version
        with other bytes from another incarnation): :meth:`maybe_swap` has something to do."""
        return self.newest is not None and not self._have(self.newest)

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
            self.refused = (f"weights {label(ann.version, ann.incarnation)} refused: the learner's pipeline contract "
                            f"is {ann.contract}, this producer's {self.contract}; give every role the same pipeline "
                            "section")
            log.error("%s", self.refused)
            return
        self.newest, self.refused = ann, ""
        self.lag.observe(self.version, ann.version)

    def maybe_swap(self, load: Callable[[Path, int], None]) -> Swap | None:
        """If weights other than ours were announced (another version, or ours from another incarnation with other
        bytes), fetch them and ``load(model_dir, version)``; None if there is nothing to do. A version that fails
        while a newer one is announced is skipped for that one at once (counted in :attr:`skipped`); the newest
        failing raises WeightFetchError (the caller reports it and keeps its weights) and is not tried again for
        ``retry_after_s``."""
        while True:
            ann = self.newest
            if ann is None:
                return None
            if self._have(ann):
                self._adopt(ann)
                return None
            key = (ann.version, ann.incarnation, ann.sha256)
            failed = self._failed_at.get(key)
            if failed is not None and time.monotonic() - failed < self.retry_after_s:
                return None
            t0 = time.perf_counter()
            try:
                path = self.fetcher.fetch(ann, superseded=functools.partial(self._superseded, ann))
            except WeightFetchError as exc:
                self._failed_at[key] = time.monotonic()
                if self._superseded(ann):
                    self.skipped += 1
                    log.warning("weights %s skipped for the newer %s: %s", label(ann.version, ann.incarnation),
                                self._newest_label(), exc)
                    continue
                log.error("weights %s unavailable, generating with %s meanwhile: %s",
                          label(ann.version, ann.incarnation), label(self.version, self.incarnation), exc)
                raise
            load(path.parent, ann.version)
            self.version, self.sha256, self.incarnation = ann.version, ann.sha256, ann.incarnation
            self._failed_at.pop(key, None)
            self.lag.observe(self.version, self.newest_version)
            return Swap(ann.version, ann.published_at, time.perf_counter() - t0, ann.incarnation)

    def _have(self, ann: wire.WeightsAnnouncement) -> bool:
        """Whether ``ann`` is what we generate with (a learner that resumed from an older checkpoint announces the
        same version numbers again, with other weights, under a higher incarnation). Once we know our bytes, the
        version and the sha256 decide: the same bytes under another incarnation need no reload (:meth:`_adopt`).
        The initial weights' bytes are unknown: the version and the incarnation decide."""
        if ann.version != self.version:
            return False
        return ann.sha256 == self.sha256 if self.sha256 else ann.incarnation == self.incarnation

    def _adopt(self, ann: wire.WeightsAnnouncement) -> None:
        """Take ``ann``'s incarnation for the weights we have (the same version and bytes, announced again)."""
        if ann.incarnation != self.incarnation:
            log.info("weights %s: the same bytes as our %s; adopted without a reload",
                     label(ann.version, ann.incarnation), label(self.version, self.incarnation))
            self.incarnation = ann.incarnation

    def _superseded(self, ann: wire.WeightsAnnouncement) -> bool:
        """Whether another announcement replaced ``ann`` (read now: this runs while a fetch of ``ann`` waits)."""
        self.poll()
        if self.newest is None:
            return False
        return (self.newest.version, self.newest.incarnation, self.newest.sha256) != (ann.version, ann.incarnation,
                                                                                       ann.sha256)


class LagWatch:
    """Unhealthy while the producer generates with a version more than ``max_lag`` behind the newest announced one
    for longer than ``grace_s`` (a stuck fetch, a consumer the client library left wedged): the process answers
    /health 503 instead of 200, so an orchestrator restarts it. ``max_lag`` < 0 or ``grace_s`` <= 0: off."""

    def __init__(self, max_lag: int, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_lag, self.grace_s, self.clock = max_lag, grace_s, clock
        self.behind_since: float | None = None
        self.lag = 0

    def observe(self, version: int, newest: int) -> None:
        self.lag = newest - version
        if self.max_lag < 0 or self.lag <= self.max_lag:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = self.clock()

    def check(self) -> tuple[bool, dict[str, object]]:
        behind_s = 0.0 if self.behind_since is None else self.clock() - self.behind_since
        too_long = self.grace_s > 0 and self.behind_since is not None and behind_s >= self.grace_s
        return not too_long, {"version_lag": self.lag, "behind_s": round(behind_s, 1)}
