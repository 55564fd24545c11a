"""Announcements on the compacted ``weights`` topic: sending one, and catching up on the latest.

The announcement says where a version's bytes are and what they hash to (never the bytes). Keyed by run name on a
compacted topic, so the latest version of every run is always there for a producer that starts late.
"""

from __future__ import annotations

import logging
from typing import Any

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import Record, UnknownTopicOrPartitionError, read_topic, send_acked
from grpo_core.weights.common import WeightFetchError

log = logging.getLogger("grpo_core.weights")


def announce(producer: Any, topic: str, ann: wire.WeightsAnnouncement) -> None:
    """Send ``ann`` keyed by its run and wait for the broker's ack (acks=all): a returned call means durable."""
    send_acked(producer, topic, wire.encode(ann), ann.run.encode(), f"announce {ann.run} v{ann.version}")
    log.info("weights: announced %s v%d at %s", ann.run, ann.version, ann.location)


def latest_announcement(kafka: KafkaConfig, topic: str, run: str,
                        timeout_s: float = 30.0) -> wire.WeightsAnnouncement | None:
    """The current announcement for ``run`` (see :func:`read_announcements`)."""
    return read_announcements(kafka, topic, run, timeout_s)[0]


def read_announcements(kafka: KafkaConfig, topic: str, run: str,
                       timeout_s: float = 30.0) -> tuple[wire.WeightsAnnouncement | None, int]:
    """``(current announcement, highest version announced)`` for ``run``: read the compacted weights topic from
    the beginning to the end offsets taken at the start. The current one is the *last valid record written* for
    the run (None if there is none, or if the last word is a tombstone). In normal operation that is the highest
    version; after a learner rewound to a checkpoint and re-published, it is the re-published one -- the same
    answer compaction will eventually leave, so a new producer's view does not depend on when the log cleaner last
    ran. The highest version (-1 if none) is what is still retained. Undecodable or mis-keyed records are skipped
    with a warning. Raises WeightFetchError if the topic is missing or the end is not reached within
    ``timeout_s``."""
    try:
        records = read_topic(kafka, topic, timeout_s, role="weights-catchup")
    except UnknownTopicOrPartitionError:
        raise WeightFetchError(f"weights topic {topic!r} not found (run `grpo-stream topics create`)") from None
    except TimeoutError as exc:
        raise WeightFetchError(f"weights topic {topic!r}: end not reached within {timeout_s:.0f}s") from exc
    key, latest, highest = run.encode(), None, -1
    for msg in records:
        if msg.key == key:
            latest = _apply_announcement(msg, run, latest)
            highest = max(highest, latest.version if latest is not None else -1)
    return latest, highest


def _apply_announcement(msg: Record, run: str,
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

