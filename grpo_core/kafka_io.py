"""Kafka helpers every role uses: client factories, the offset-commit rule, dead letters, lag.

This module (with :mod:`grpo_core.topics`, :mod:`grpo_core.kafka_patches` and the kafka weight store) is the seam
to the Kafka client library: nothing above the core imports ``kafka`` (the import contract in pyproject.toml
forbids it). Services name the client's types through the aliases below (:data:`Record`, :data:`Partition`,
:data:`Consumer`, :data:`BrokerError`, ...), so a change of client touches the core only.

Reliability in grpo-stream rests on two rules implemented here once:

* :func:`commit_processed` -- offsets are committed explicitly, and only for records whose effect is durable.
* :class:`DeadLetters` -- a record that cannot be decoded or validated is copied, bytes and coordinates and
  reason, to the ``dlq`` topic; only then may its offset be committed. Nothing is lost and nothing crashes.

How a client connects (a bounded wait for the broker) and how an outage is reported (one WARNING, one INFO
when it is over, whatever the number of calls that failed) is :mod:`grpo_core.kafka_connect`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias, TypeVar, cast

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import OffsetSpec
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from kafka.errors import UnknownTopicOrPartitionError as UnknownTopicOrPartitionError
from kafka.producer.future import FutureRecordMetadata
from kafka.structs import OffsetAndMetadata

from grpo_core import kafka_patches, wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_connect import BROKER, client_settings, connect, is_outage
from grpo_core.kafka_connect import LOGIN_ERRORS as LOGIN_ERRORS
from grpo_core.kafka_connect import BrokerLoginError as BrokerLoginError
from grpo_core.kafka_connect import BrokerUnreachable as BrokerUnreachable
from grpo_core.kafka_connect import redacted as redacted
from grpo_core.kafka_connect import with_retry as with_retry
from grpo_core.retry import backoff_delay as retry_delay

log = logging.getLogger(__name__)
kafka_patches.apply()  # every client of the code base is made here: faster receives for large records
T = TypeVar("T")
R = TypeVar("R", bound=wire.Record)

# The client's types, as the rest of the code base names them.
Record = ConsumerRecord  # .topic .partition .offset .key .value .timestamp
Partition = TopicPartition  # (topic, partition)
Consumer = KafkaConsumer
Producer = KafkaProducer
Admin = KafkaAdminClient
SendFuture: TypeAlias = FutureRecordMetadata
RebalanceListener = ConsumerRebalanceListener
BrokerError = KafkaError  # every error the client raises for the broker or the connection


# ------------------------------------------------------------------------------------------ clients


CLOSE_S = 10.0  # how long closing a producer waits for records still unacknowledged, then drops them


class BoundedCloseProducer(KafkaProducer):  # type: ignore[misc]  # kafka-python has no type hints
    """A producer whose ``close()`` returns within a bound even when no broker answers.

    kafka-python's ``close()`` waits forever by default, and with a timeout it raises from its ``flush`` and leaves
    the sender thread alive, so a role stopping during a broker outage hangs in its shutdown. Dropping what is
    still unsent is safe: every role treats a record as done only once it is acknowledged (:func:`acked`), so an
    unacknowledged one is produced again after the restart, and consumers deduplicate.
    """

    def close(self, timeout: float | None = None, null_logger: bool = False) -> None:
        bound = CLOSE_S if timeout is None else timeout
        sender = getattr(self, "_sender", None)
        if not getattr(self, "_closed", True) and sender is not None:
            try:
                self.flush(bound)
            except KafkaTimeoutError:
                log.warning("closing a producer with records still unacknowledged after %.0f s: dropped", bound)
                sender.force_close()  # fails the pending batches, so close()'s own flush returns at once
                sender.join(bound)
        super().close(timeout=bound, null_logger=null_logger)


def make_producer(cfg: KafkaConfig, role: str, **overrides: Any) -> KafkaProducer:
    """acks=all + idempotence: a broker-acknowledged record survives a broker failover and a retried send
    is never written twice. Compression is lz4 by default: cheapest CPU per byte, and our payloads (packed
    float32 logprobs, token ids) gain little from a stronger codec."""
    settings = client_settings(cfg, role) | {
        "acks": "all",
        "enable_idempotence": True,
        "compression_type": None if cfg.compression == "none" else cfg.compression,
        "max_request_size": cfg.max_record_bytes,
        "linger_ms": 5,
        "batch_size": 1024 * 1024,
        "allow_auto_create_topics": False,
    } | overrides
    return connect(lambda wait_s: BoundedCloseProducer(**settings | _bootstrap_wait(wait_s)), cfg, role, "producer")


def make_consumer(cfg: KafkaConfig, role: str, group_id: str | None, topics: Iterable[str] = (),
                  listener: Any = None, **overrides: Any) -> KafkaConsumer:
    """Manual commits only (see :func:`commit_processed`); new groups start from the earliest record."""
    settings = client_settings(cfg, role) | {
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": cfg.max_record_bytes,
        "fetch_max_bytes": max(cfg.max_record_bytes, 52_428_800),
        "isolation_level": "read_committed",
        "allow_auto_create_topics": False,
    } | overrides
    consumer = connect(lambda wait_s: KafkaConsumer(**settings | _bootstrap_wait(wait_s)), cfg, role, "consumer")
    topics = list(topics)
    for topic in topics:
        # Subscribe only once the partitions are known: a group leader that assigns before its metadata has a
        # just-created topic hands out nothing, and the group can then sit with an empty assignment.
        # (mypy cannot infer a lambda with a default argument: the ignore below)
        with_retry(lambda t=topic: require_partitions(consumer, t),  # type: ignore[misc]
                   f"{role}: metadata of {topic}")
    if topics:
        consumer.subscribe(topics, listener=listener)
        # One metadata refresh *after* subscribing, before the first join. kafka-python 3.0 snapshots the
        # subscribed topics' partitions only on a metadata update; without this the first assignment is made
        # against an empty snapshot, the next update triggers a second join, and a poll() timing out during
        # that second join leaves the member wedged for good (no fetches, no heartbeats, silently expelled).
        with_retry(lambda: _refresh_metadata(consumer, topics), f"{role}: metadata after subscribing")
    return consumer


OUTAGE_S = 3600.0  # how long a send waits for its ack through a broker that does not answer, then raises
ACK_WAIT_S = 30.0  # one wait on a send's future before saying that it still waits


def acked(future: SendFuture, resend: Callable[[], SendFuture], what: str, outage_s: float = OUTAGE_S) -> Any:
    """Wait for a send's ack through a broker outage: a broker restart is a pause for whoever waits on a send.

    While the future is pending, keep waiting (the client retries inside ``delivery_timeout_ms``); when the
    client gave up on it (a failed future, e.g. the delivery timeout during a long outage), send it again after
    a backoff. A re-send can duplicate a record whose ack was lost: every topic is read by a deduplicating
    consumer (group ids, dead letters keyed by their source, announcements compacted per run). Errors that are
    not retriable, or an outage longer than ``outage_s``, raise."""
    deadline, attempt = time.monotonic() + outage_s, 0
    while True:
        try:
            result = future.get(timeout=ACK_WAIT_S)
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() > deadline:
                raise
            if future.is_done:  # the client gave up on this one: ours to send again
                attempt += 1
                delay = retry_delay(attempt, 1.0)
                BROKER.failed(f"{what}: send (again in {delay:.0f}s)", exc)
                time.sleep(delay)
                future = resend()
            else:
                BROKER.failed(f"{what}: no ack after {ACK_WAIT_S:.0f}s, still waiting", exc)
        else:
            BROKER.succeeded(what)
            return result


def send_acked(producer: KafkaProducer, topic: str, value: bytes, key: bytes | None, what: str) -> Any:
    """Send one record and wait for its ack (through an outage: :func:`acked`)."""
    def send() -> SendFuture:
        return producer.send(topic, key=key, value=value)

    return acked(send(), send, what)


def poll(consumer: KafkaConsumer, timeout_ms: int,
         max_records: int | None = None) -> dict[TopicPartition, list[ConsumerRecord]]:
    """``consumer.poll`` through a broker restart: a broker that does not answer is an empty poll, not a crash.

    kafka-python 3.0.12 lets a failed metadata refresh escape ``poll`` as ``KafkaConnectionError`` while the
    broker is down (seen in the chaos run: a verifier died of it); the client reconnects and rejoins its group
    by itself on a later poll, so retriable errors wait a little and return nothing (reported to :data:`BROKER`).
    Others still raise."""
    try:
        polled: dict[TopicPartition, list[ConsumerRecord]] = consumer.poll(timeout_ms=timeout_ms,
                                                                           max_records=max_records)
    except KafkaError as exc:
        if not exc.retriable:
            raise
        BROKER.failed("poll", exc)
        time.sleep(max(0.1, min(1.0, timeout_ms / 1000)))
        return {}
    _watch_connection(consumer)
    return polled


_seen_connected: weakref.WeakSet[KafkaConsumer] = weakref.WeakSet()


def _watch_connection(consumer: KafkaConsumer) -> None:
    """Report the broker's coming and going as a consumer's connections show it: a poll through an outage
    raises nothing (the client reconnects by itself), so a role that only polls would never say that the broker
    is gone. A consumer counts once it was seen connected (right after its bootstrap it holds no connection)."""
    conns = getattr(getattr(getattr(consumer, "_client", None), "_manager", None), "_conns", None)
    if not isinstance(conns, dict):  # not kafka-python 3.0's connection manager: nothing to watch
        return
    if any(getattr(conn, "connected", False) for conn in list(conns.values())):
        _seen_connected.add(consumer)
        BROKER.succeeded("poll")
    elif consumer in _seen_connected:
        BROKER.failed("poll", KafkaConnectionError("no connection to any broker"))


def _refresh_metadata(consumer: KafkaConsumer, topics: list[str]) -> None:
    missing = set(topics) - consumer.topics()  # topics() always asks the broker
    if missing:
        raise UnknownTopicOrPartitionError(f"topics {sorted(missing)} vanished while subscribing")


def require_partitions(consumer: KafkaConsumer, topic: str) -> set[int]:
    """The topic's partitions as the consumer's metadata knows them; raises (retryable) if there are none."""
    found: set[int] | None = consumer.partitions_for_topic(topic)
    if not found:
        raise UnknownTopicOrPartitionError(
            f"topic {topic} has no known partitions (create it: grpo-stream topics create)")
    return found


def make_admin(cfg: KafkaConfig, role: str = "admin") -> KafkaAdminClient:
    return connect(lambda wait_s: KafkaAdminClient(**client_settings(cfg, role) | _bootstrap_wait(wait_s)), cfg, role,
                   "admin")


def _bootstrap_wait(wait_s: float) -> dict[str, int]:
    """How long a new client's own bootstrap loop may wait: what is left of kafka.connect_timeout_s."""
    return {"bootstrap_timeout_ms": int(wait_s * 1000)}


# ------------------------------------------------------------------------------------------ the commit rule


def commit_processed(consumer: KafkaConsumer, next_offsets: Mapping[TopicPartition, int]) -> bool:
    """THE offset-commit rule: commit ``next_offsets`` (the offset of the next record to read, per partition)
    only after the effect of every record below them is durable -- published and acknowledged downstream,
    written to the dlq, or saved in a checkpoint. Kafka resumes a restarted consumer group at the committed
    offset, so committing earlier could lose a record and committing later only re-delivers (which every
    consumer tolerates by deduplicating on record identity). Callers pass only durable progress; nothing
    else in the code base commits offsets.

    A commit the broker does not take (broker down, or this member dropped from the group while it was) is not
    fatal: it returns False and the next commit carries the same or later offsets, since offsets only move
    forward. Until then a restart or a rebalance re-delivers those records, which is the safe direction."""
    if not next_offsets:
        return True
    try:
        consumer.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in next_offsets.items()})
    except KafkaError as exc:
        if is_outage(exc):
            BROKER.failed("offset commit (the next commit retries it)", exc)
        else:
            log.warning("offset commit not taken (%s: %s); the next commit retries it", type(exc).__name__, exc)
        return False
    BROKER.succeeded("offset commit")
    return True


# ------------------------------------------------------------------------------------------ dead letters


# Room a dead letter needs beyond its raw bytes: reason, coordinates, key, field names, record and batch headers.
DEAD_LETTER_OVERHEAD_BYTES = 64 * 1024
MAX_DEAD_KEY_BYTES = 4096


def dead_letter_key(topic: str, partition: int, offset: int) -> bytes:
    """The dlq key of a dead letter: its source coordinates, so a record dead-lettered again after a replay is
    recognised as the same one: counting distinct keys counts each bad record once."""
    return f"{topic}/{partition}/{offset}".encode()


class DeadLetters:
    """Writes undecodable/invalid records to the dlq topic and counts them by reason.

    A dead letter always fits the dlq: ``max_record_bytes`` is the smaller of the client's and the dlq topic's
    record limits, and a record too large to be copied whole keeps a prefix, its full size and its sha256."""

    def __init__(self, producer: KafkaProducer, topic: str, service: str,
                 on_dead: Callable[[str], None] | None = None, max_record_bytes: int = 1 << 20) -> None:
        self.producer, self.topic, self.service = producer, topic, service
        self.on_dead = on_dead or (lambda reason: None)
        self.max_raw = max(0, max_record_bytes - DEAD_LETTER_OVERHEAD_BYTES)

    def letter(self, msg: ConsumerRecord, reason: str) -> wire.DeadLetter:
        raw = bytes(msg.value or b"")
        cut = len(raw) > self.max_raw
        return wire.DeadLetter(
            source_topic=msg.topic, partition=msg.partition, offset=msg.offset, reason=reason[:4000],
            raw=raw[:self.max_raw], service=self.service, key=bytes(msg.key or b"")[:MAX_DEAD_KEY_BYTES],
            at=wire.now(), raw_size=len(raw), raw_sha256=hashlib.sha256(raw).hexdigest(), truncated=cut)

    def send(self, msg: ConsumerRecord, reason: str) -> None:
        """Publish one dead letter and wait for the broker's ack: the caller commits past it afterwards."""
        letter = self.letter(msg, reason)
        key = dead_letter_key(msg.topic, msg.partition, msg.offset)
        send_acked(self.producer, self.topic, wire.encode(letter), key, f"{self.service}: dead letter")
        log.warning("%s: dead-lettered %s[%d]@%d: %s", self.service, msg.topic, msg.partition, msg.offset, reason)
        self.on_dead(reason.split(":", 1)[0])

    def decode(self, msg: ConsumerRecord, expected: type[R]) -> R | None:
        """Decode ``msg`` as ``expected``; on failure dead-letter it and return None (the caller moves on)."""
        return self.decode_or_reason(msg, expected)[0]

    def decode_or_reason(self, msg: ConsumerRecord, expected: type[R]) -> tuple[R | None, str]:
        """As :meth:`decode`, with the dead letter's reason ('' when it decoded) for the caller's records."""
        try:
            return wire.decode(msg.value, expected), ""
        except wire.WireError as exc:
            reason = f"decode: {exc}"
            self.send(msg, reason)
            return None, reason


# ------------------------------------------------------------------------------------------ lag


def end_offsets(admin: KafkaAdminClient, topic: str, partitions: Iterable[int]) -> dict[int, int]:
    specs = {TopicPartition(topic, p): OffsetSpec.LATEST for p in partitions}
    return {tp.partition: o.offset for tp, o in admin.list_partition_offsets(specs).items()}


def begin_offsets(admin: KafkaAdminClient, topic: str, partitions: Iterable[int]) -> dict[int, int]:
    specs = {TopicPartition(topic, p): OffsetSpec.EARLIEST for p in partitions}
    return {tp.partition: o.offset for tp, o in admin.list_partition_offsets(specs).items()}


def partitions_of(admin: KafkaAdminClient, topic: str) -> list[int]:
    (meta,) = admin.describe_topics([topic])
    if meta.get("error_code", 0):
        raise KafkaError(f"topic {topic}: error code {meta['error_code']}")
    return sorted(p["partition_index"] for p in meta["partitions"])


def read_topic(cfg: KafkaConfig, topic: str, timeout_s: float = 120.0, role: str = "reader") -> list[ConsumerRecord]:
    """Every record of ``topic`` from its beginning to the end offsets at the call, in partition/offset order
    (catch-ups, audits, tools; no consumer group, nothing committed). Raises ``UnknownTopicOrPartitionError``
    for a topic without partitions and ``TimeoutError`` when the end is not reached within ``timeout_s``."""
    consumer = make_consumer(cfg, role, None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(require_partitions(consumer, topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: dict[TopicPartition, list[ConsumerRecord]] = {tp: [] for tp in tps}
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic!r}: its end was not reached within {timeout_s:.0f}s")
            for tp, msgs in poll(consumer, 200).items():
                out[tp] += [m for m in msgs if m.offset < ends[tp]]
        return [m for tp in tps for m in out[tp]]
    finally:
        consumer.close()


def committed_offsets(admin: KafkaAdminClient, group: str, topic: str) -> dict[int, int]:
    """The group's committed next-offset per partition of ``topic`` (partitions it never committed are absent)."""
    offsets = admin.list_group_offsets({group: None}).get(group, {})
    return {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == topic and om.offset >= 0}


def assigned_lag(consumer: KafkaConsumer, positions: Mapping[int, int] | None = None) -> int | None:
    """This consumer's own view of its lag: records between its position and the log end, summed over its
    assignment. ``positions`` (next offset per partition) replaces the client's position where the caller keeps
    its own (the learner's checkpointed positions); a partition missing there counts as caught up. None when the
    broker does not answer: a metric, never a reason to stop (a broker restart must be a pause)."""
    assigned = list(consumer.assignment())
    if not assigned:
        return 0
    try:
        ends: dict[TopicPartition, int] = consumer.end_offsets(assigned)
    except KafkaError as exc:
        if is_outage(exc):
            BROKER.failed("lag", exc)
        else:
            log.warning("lag unknown (%s: %s)", type(exc).__name__, exc)
        return None
    BROKER.succeeded("lag")
    if positions is None:
        return sum(max(0, end - cast(int, consumer.position(tp))) for tp, end in ends.items())
    return sum(max(0, end - positions.get(tp.partition, end)) for tp, end in ends.items())


def consumer_lag(admin: KafkaAdminClient, group: str, topic: str) -> dict[int, int]:
    """Per partition: log-end offset minus the group's committed offset -- records the group has yet to
    process. A partition the group never committed counts from its earliest retained record."""
    parts = partitions_of(admin, topic)
    ends, begins = end_offsets(admin, topic, parts), begin_offsets(admin, topic, parts)
    committed = committed_offsets(admin, group, topic)
    return {p: max(0, ends[p] - committed.get(p, begins[p])) for p in parts}
