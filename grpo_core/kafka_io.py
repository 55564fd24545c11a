"""Kafka helpers every role uses: client factories, the offset-commit rule, dead letters, lag.

This module (with :mod:`grpo_core.topics`, :mod:`grpo_core.kafka_patches` and the kafka weight store) is the seam
to the Kafka client library: nothing above the core imports ``kafka`` (the import contract in pyproject.toml
forbids it). Services name the client's types through the aliases below (:data:`Record`, :data:`Partition`,
:data:`Consumer`, :data:`BrokerError`, ...), so a change of client touches the core only.

Reliability in grpo-stream rests on two rules implemented here once:

* :func:`commit_processed` -- offsets are committed explicitly, and only for records whose effect is durable.
* :class:`DeadLetters` -- a record that cannot be decoded or validated is copied, bytes and coordinates and
  reason, to the ``dlq`` topic; only then may its offset be committed. Nothing is lost and nothing crashes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import OffsetSpec
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import (
    IllegalSaslStateError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailedError,
    UnknownTopicOrPartitionError,
    UnsupportedSaslMechanismError,
)
from kafka.producer.future import FutureRecordMetadata
from kafka.structs import OffsetAndMetadata

from grpo_core import kafka_patches, wire
from grpo_core.config import ConfigError, KafkaConfig
from grpo_core.retry import backoff_delay as retry_delay
from grpo_core.retry import retry

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
SendFuture = FutureRecordMetadata
RebalanceListener = ConsumerRebalanceListener
BrokerError = KafkaError  # every error the client raises for the broker or the connection


# ------------------------------------------------------------------------------------------ clients


def client_settings(cfg: KafkaConfig, role: str) -> dict[str, Any]:
    """Connection + security settings shared by every client (the secret comes from the environment)."""
    settings: dict[str, Any] = {
        "bootstrap_servers": cfg.resolved_bootstrap().split(","),
        "client_id": f"{cfg.client_id}-{role}-{socket.gethostname()}-{os.getpid()}",
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": cfg.request_timeout_ms,
        # kafka-python refuses any response larger than this: it must cover the largest fetch we ask for.
        "receive_message_max_bytes": max(2 * cfg.max_record_bytes, 100 * 1024 * 1024),
    }
    if cfg.sasl_mechanism:
        settings.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                        sasl_plain_password=cfg.sasl_password())
    for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if getattr(cfg, key):
            settings[key] = getattr(cfg, key)
    return settings


def redacted(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings safe to log: secrets replaced."""
    return {k: ("***" if "password" in k and v else v) for k, v in settings.items()}


LOGIN_ERRORS = (SaslAuthenticationFailedError, UnsupportedSaslMechanismError, IllegalSaslStateError)


class BrokerLoginError(ConfigError):
    """The broker refused this client's credentials: a setting to fix, not an outage to wait out."""


class _RefusedLoginEndsBootstrap(logging.Filter):
    """kafka-python's bootstrap loop catches a refused SASL login, logs it and tries again until its
    ``bootstrap_timeout_ms`` (30 s); then :func:`with_retry` would start it over: a wrong password would pass
    for a broker outage for minutes. The loop logs the error object as an argument of that warning; raising it
    from the log call ends the loop at once (:func:`_connect` turns it into :class:`BrokerLoginError`).
    ``tests/test_security.py`` holds the pinned kafka-python to this."""

    def filter(self, record: logging.LogRecord) -> bool:
        for arg in record.args if isinstance(record.args, tuple) else ():
            if isinstance(arg, LOGIN_ERRORS):
                raise arg
        return True


_bootstrap_log = logging.getLogger("kafka.net.manager")
_bootstrap_log.addFilter(_RefusedLoginEndsBootstrap())
if _bootstrap_log.getEffectiveLevel() > logging.WARNING:  # a filter only sees records its logger lets through
    _bootstrap_log.setLevel(logging.WARNING)


def with_retry(fn: Callable[[], T], what: str, attempts: int = 10, backoff_s: float = 0.5) -> T:
    """Retry a broker call (connect, metadata, offsets) with exponential backoff (:func:`grpo_core.retry.retry`).
    kafka-python 3 raises KafkaError subclasses when no broker answers, OSError for socket failures; a refused
    login is raised at once."""
    return retry(fn, what, attempts=attempts, backoff_s=backoff_s, transient=(KafkaError, OSError),
                 fatal=LOGIN_ERRORS)


def _connect(make: Callable[[], T], cfg: KafkaConfig, role: str, what: str) -> T:
    """A new client, retried while no broker answers; a refused login fails fast, naming what to check."""
    try:
        return with_retry(make, f"{role}: connect {what}")
    except LOGIN_ERRORS as exc:
        password = f"the password in ${cfg.sasl_password_env}" if cfg.sasl_password_env else "no password set"
        raise BrokerLoginError(
            f"{role}: the broker at {cfg.resolved_bootstrap()} refused the login of {what} (listener "
            f"{cfg.security_protocol}, mechanism {cfg.sasl_mechanism}, user {cfg.sasl_username!r}): "
            f"{type(exc).__name__}: {exc}. Check kafka.sasl_username and {password}") from None


CLOSE_S = 10.0  # how long closing a producer waits for records still unacknowledged, then drops them


class BoundedCloseProducer(KafkaProducer):
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
    return _connect(lambda: BoundedCloseProducer(**settings), cfg, role, "producer")


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
    consumer = _connect(lambda: KafkaConsumer(**settings), cfg, role, "consumer")
    topics = list(topics)
    for topic in topics:
        # Subscribe only once the partitions are known: a group leader that assigns before its metadata has a
        # just-created topic hands out nothing, and the group can then sit with an empty assignment.
        with_retry(lambda t=topic: require_partitions(consumer, t), f"{role}: metadata of {topic}")
    if topics:
        consumer.subscribe(topics, listener=listener)
        # One metadata refresh *after* subscribing, before the first join. kafka-python 3.0 snapshots the
        # subscribed topics' partitions only on a metadata update; without this the first assignment is made
        # against an empty snapshot, the next update triggers a second join, and a poll() timing out during
        # that second join leaves the member wedged for good (no fetches, no heartbeats, silently expelled).
        with_retry(lambda: _refresh_metadata(consumer, topics), f"{role}: metadata after subscribing")
    return consumer


_last_poll_warning = 0.0
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
            return future.get(timeout=ACK_WAIT_S)
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() > deadline:
                raise
            if future.is_done:  # the client gave up on this one: ours to send again
                attempt += 1
                delay = retry_delay(attempt, 1.0)
                log.warning("%s: send failed (%s: %s); sending again in %.0fs", what, type(exc).__name__, exc, delay)
                time.sleep(delay)
                future = resend()
            else:
                log.warning("%s: no ack after %.0fs (%s); still waiting", what, ACK_WAIT_S, type(exc).__name__)


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
    by itself on a later poll, so retriable errors wait a little and return nothing. Others still raise."""
    global _last_poll_warning
    try:
        return consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
    except KafkaError as exc:
        if not exc.retriable:
            raise
        if time.monotonic() - _last_poll_warning > 10.0:
            _last_poll_warning = time.monotonic()
            log.warning("poll: the broker does not answer (%s: %s); retrying", type(exc).__name__, exc)
        time.sleep(max(0.1, min(1.0, timeout_ms / 1000)))
        return {}


def _refresh_metadata(consumer: KafkaConsumer, topics: list[str]) -> None:
    missing = set(topics) - consumer.topics()  # topics() always asks the broker
    if missing:
        raise UnknownTopicOrPartitionError(f"topics {sorted(missing)} vanished while subscribing")


def require_partitions(consumer: KafkaConsumer, topic: str) -> set[int]:
    """The topic's partitions as the consumer's metadata knows them; raises (retryable) if there are none."""
    found = consumer.partitions_for_topic(topic)
    if not found:
        raise UnknownTopicOrPartitionError(
            f"topic {topic} has no known partitions (create it: grpo-stream topics create)")
    return found


def make_admin(cfg: KafkaConfig, role: str = "admin") -> KafkaAdminClient:
    return _connect(lambda: KafkaAdminClient(**client_settings(cfg, role)), cfg, role, "admin")


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
        log.warning("offset commit not taken (%s: %s); the next commit retries it", type(exc).__name__, exc)
        return False
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
        ends = consumer.end_offsets(assigned)
    except KafkaError as exc:
        log.warning("lag unknown (%s: %s)", type(exc).__name__, exc)
        return None
    if positions is None:
        return sum(max(0, end - consumer.position(tp)) for tp, end in ends.items())
    return sum(max(0, end - positions.get(tp.partition, end)) for tp, end in ends.items())


def consumer_lag(admin: KafkaAdminClient, group: str, topic: str) -> dict[int, int]:
    """Per partition: log-end offset minus the group's committed offset -- records the group has yet to
    process. A partition the group never committed counts from its earliest retained record."""
    parts = partitions_of(admin, topic)
    ends, begins = end_offsets(admin, topic, parts), begin_offsets(admin, topic, parts)
    committed = committed_offsets(admin, group, topic)
    return {p: max(0, ends[p] - committed.get(p, begins[p])) for p in parts}
