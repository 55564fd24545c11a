"""Kafka helpers against the real broker: delivery guarantees, restart survival, dead letters, lag."""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, TopicPartition

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import (
    DeadLetters,
    client_settings,
    commit_processed,
    consumer_lag,
    make_consumer,
    make_producer,
    redacted,
)
from grpo_stream.bench.wire import make_completion
from grpo_stream.broker import LocalBroker, free_port


def _small_completion(group: int, index: int) -> wire.Completion:
    return make_completion(f"p{group}@e0r0", index, group_size=8, tokens=16, prompt_tokens=8,
                           rng=np.random.default_rng(group * 8 + index))


def _poll_until(consumer: KafkaConsumer, n: int, timeout_s: float = 60.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            out.extend(batch)
    return out


def _commit_batch(consumer: KafkaConsumer, msgs: list) -> None:
    nxt: dict[TopicPartition, int] = {}
    for m in msgs:
        tp = TopicPartition(m.topic, m.partition)
        nxt[tp] = max(nxt.get(tp, 0), m.offset + 1)
    commit_processed(consumer, nxt)


def test_ten_thousand_completions_through_a_consumer_group(kafka_cfg: KafkaConfig, new_topic: Callable,
                                                           unique: Callable) -> None:
    topic, group, n_groups, g = new_topic("completions", partitions=4), unique("grp"), 1250, 8
    consumers = [make_consumer(kafka_cfg, "test", group, [topic]) for _ in range(2)]
    got: list[list] = [[], []]
    stop = threading.Event()

    def run(i: int) -> None:
        while not stop.is_set():
            batch = [m for msgs in consumers[i].poll(timeout_ms=200).values() for m in msgs]
            got[i].extend((m.partition, m.offset, wire.decode(m.value, wire.Completion)) for m in batch)
            _commit_batch(consumers[i], batch)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # Both members must hold partitions before data flows: a rebalance mid-stream legitimately re-delivers.
    def settled() -> bool:  # both hold partitions, and together exactly the 4 (no overlap mid-rebalance)
        parts = [set(c.assignment()) for c in consumers]
        return all(parts) and not (parts[0] & parts[1]) and len(parts[0] | parts[1]) == 4

    deadline = time.monotonic() + 120
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled(), "group did not stabilise"
    producer = make_producer(kafka_cfg, "test")
    sent = []
    for grp in range(n_groups):
        for idx in range(g):
            c = _small_completion(grp, idx)
            producer.send(topic, key=c.group_id.encode(), value=wire.encode(c))
            sent.append((c.group_id, c.index))
    producer.flush()
    deadline = time.monotonic() + 120
    while sum(map(len, got)) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # anything extra (a duplicate) would arrive now
    stop.set()
    for t in threads:
        t.join()
    records = got[0] + got[1]
    ids = [(r.group_id, r.index) for _, _, r in records]
    assert len(ids) == len(sent) == 10_000
    assert len(set(ids)) == len(ids), "a record was delivered twice"
    assert set(ids) == set(sent)
    assert got[0] and got[1], "both group members should have done work"
    by_partition: dict[int, list[int]] = {}
    partition_of_group: dict[str, int] = {}
    for part, off, rec in records:
        by_partition.setdefault(part, []).append(off)
        assert partition_of_group.setdefault(rec.group_id, part) == part, "a group's siblings split partitions"
    for offsets in by_partition.values():
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), "out of order within a partition"
    for c in records_by_group(records).values():
        assert c == sorted(c), "siblings of one group arrived out of order"
    for c in consumers:
        c.close()
    producer.close()


def records_by_group(records: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _, _, r in records:
        out.setdefault(r.group_id, []).append(r.index)
    return out


def _create_topic(bootstrap: str, name: str) -> None:
    """One partition on a test's own broker."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics({name: {"num_partitions": 1, "replication_factor": 1}})
    admin.wait_for_topics([name])
    admin.close()


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_broker_restart_keeps_data_and_committed_offsets(tmp_path: Path) -> None:
    port, ctl = free_port(), free_port()
    broker = LocalBroker(data_dir=tmp_path / "kafka", port=port, controller_port=ctl)
    broker.up(fresh=True)
    try:
        cfg = KafkaConfig(bootstrap=broker.bootstrap)
        _create_topic(broker.bootstrap, "survive")
        producer = make_producer(cfg, "test")
        for i in range(100):
            producer.send("survive", value=wire.encode(_small_completion(i, 0)))
        producer.flush()
        producer.close()
        consumer = make_consumer(cfg, "test", "survivors", ["survive"], max_poll_records=60)
        first = _poll_until(consumer, 60)[:60]
        _commit_batch(consumer, first)
        broker.down()
        assert not broker.status()["running"]
        broker.up()  # same data dir, same ports
        # The live consumer resumes by itself after the restart and reads on from where it was.
        rest = _poll_until(consumer, 40)
        assert [m.offset for m in first + rest] == list(range(100))
        consumer.close()
        # A new member of the group starts at the committed offset (60), which survived the restart.
        producer = make_producer(cfg, "test")
        producer.send("survive", value=wire.encode(_small_completion(100, 0))).get(timeout=30)
        producer.close()
        again = make_consumer(cfg, "test", "survivors", ["survive"])
        resumed = _poll_until(again, 41)
        assert [m.offset for m in resumed] == list(range(60, 101))
        again.close()
        # And every record is still there for a reader from the start.
        fresh = make_consumer(cfg, "test", None, ["survive"])
        assert len(_poll_until(fresh, 101)) == 101
        fresh.close()
    finally:
        broker.down()


def test_garbage_and_wrong_schema_go_to_dlq_and_consumer_goes_on(kafka_cfg: KafkaConfig, new_topic: Callable,
                                                                  unique: Callable) -> None:
    topic, dlq_topic = new_topic("completions"), new_topic("dlq")
    good = [wire.encode(_small_completion(i, 0)) for i in range(2)]
    future_schema = good[0].replace(b"\xa2_v\x01", b"\xa2_v\x02")
    assert future_schema != good[0]
    payloads = [good[0], b"\x00\xffnot msgpack at all", future_schema, good[1]]
    producer = make_producer(kafka_cfg, "test")
    for p in payloads:
        producer.send(topic, key=b"k", value=p)
    producer.flush()
    reasons: list[str] = []
    dead = DeadLetters(producer, dlq_topic, "test-service", on_dead=reasons.append)
    consumer = make_consumer(kafka_cfg, "test", unique("grp"), [topic])
    processed = []
    for msg in _poll_until(consumer, 4):
        record = dead.decode(msg, wire.Completion)
        if record is not None:
            processed.append(record.group_id)
        _commit_batch(consumer, [msg])
    assert processed == ["p0@e0r0", "p1@e0r0"], "valid records after bad ones must still be processed"
    assert reasons == ["decode", "decode"]
    reader = make_consumer(kafka_cfg, "test", None, [dlq_topic])
    letters = [wire.decode(m.value, wire.DeadLetter) for m in _poll_until(reader, 2)]
    assert [(d.source_topic, d.partition, d.offset) for d in letters] == [(topic, 0, 1), (topic, 0, 2)]
    assert letters[0].raw == payloads[1] and letters[1].raw == payloads[2]
    assert "not msgpack" in letters[0].reason
    assert "schema version 2" in letters[1].reason
    assert all(d.service == "test-service" and d.key == b"k" for d in letters)
    assert all(not d.truncated and d.raw_size == len(d.raw) for d in letters)
    tp = TopicPartition(topic, 0)
    assert consumer.committed(tp) == 4
    for c in (consumer, reader):
        c.close()
    producer.close()


def test_consumer_lag_is_log_end_minus_committed(kafka_cfg: KafkaConfig, admin: KafkaAdminClient,
                                                 new_topic: Callable, unique: Callable) -> None:
    topic, group = new_topic("groups", partitions=2), unique("learner")
    producer = make_producer(kafka_cfg, "test")
    for i in range(10):
        producer.send(topic, value=b"x", partition=i % 2)
    producer.flush()
    producer.close()
    assert consumer_lag(admin, group, topic) == {0: 5, 1: 5}, "a group that never committed lags everything"
    consumer = make_consumer(kafka_cfg, "test", group)
    consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    commit_processed(consumer, {TopicPartition(topic, 0): 4, TopicPartition(topic, 1): 1})
    assert consumer_lag(admin, group, topic) == {0: 1, 1: 4}
    consumer.close()


def test_security_settings_pass_through_without_leaking_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_PW", "s3cret")
    cfg = KafkaConfig(bootstrap="b1:9093,b2:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                      sasl_username="rl", sasl_password_env="KAFKA_PW", ssl_cafile="/etc/ca.pem")
    cfg.validate()
    s = client_settings(cfg, "learner")
    assert s["bootstrap_servers"] == ["b1:9093", "b2:9093"]
    assert (s["security_protocol"], s["sasl_mechanism"], s["sasl_plain_username"]) == ("SASL_SSL",
                                                                                        "SCRAM-SHA-512", "rl")
    assert s["sasl_plain_password"] == "s3cret" and s["ssl_cafile"] == "/etc/ca.pem"
    assert "s3cret" not in repr(redacted(s)) and "s3cret" not in repr(cfg)


class _CountAssignments(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.assigned: list[list[int]] = []

    def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.assigned.append(sorted(tp.partition for tp in assigned))


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_a_lone_member_joins_once_and_then_consumes(kafka_cfg: KafkaConfig, new_topic: Callable,
                                                     unique: Callable) -> None:
    """A second, metadata-triggered rejoin right after the first one is what wedged a verifier: kafka-python 3.0
    leaves a rejoin half done when a short poll times out during it (no fetches, no heartbeats, expelled from
    the group without noticing). make_consumer refreshes the group's view of the topic before the first join,
    so a lone member is assigned exactly once -- and then reads what is produced."""
    for _ in range(3):  # a race: several fresh groups, each polled with the short timeouts the services use
        topic = new_topic("join-once", partitions=4)
        listener = _CountAssignments()
        consumer = make_consumer(kafka_cfg, "test", unique("grp"), [topic], listener=listener)
        try:
            deadline = time.monotonic() + 30
            while not listener.assigned and time.monotonic() < deadline:
                consumer.poll(timeout_ms=20)
            settle = time.monotonic() + 3
            while time.monotonic() < settle:
                consumer.poll(timeout_ms=20)
            assert listener.assigned == [[0, 1, 2, 3]]
            producer = make_producer(kafka_cfg, "test")
            for i in range(8):
                producer.send(topic, key=str(i).encode(), value=b"x")
            producer.flush()
            producer.close()
            assert len(_poll_until(consumer, 8, timeout_s=30)) == 8
        finally:
            consumer.close()


def test_a_record_too_large_for_the_dlq_still_gets_a_dead_letter(kafka_cfg: KafkaConfig, new_topic: Callable) -> None:
    """A near-limit record (here 3 MiB) cannot be copied into a dlq that takes 1 MiB: the dead letter keeps a
    prefix, the size and the sha256, and it is keyed by the source coordinates (a replay repeats the key)."""
    topic = new_topic("prompts", configs={"max.message.bytes": str(4 << 20)})
    dlq_topic = new_topic("dlq", configs={"max.message.bytes": str(1 << 20)})
    big = bytes(range(256)) * (3 << 12)  # 3 MiB
    producer = make_producer(kafka_cfg, "test")
    producer.send(topic, key=b"big", value=big).get(timeout=30)
    source = make_consumer(kafka_cfg, "test", None, [topic])
    (msg,) = _poll_until(source, 1)
    source.close()
    dead = DeadLetters(producer, dlq_topic, "test", max_record_bytes=1 << 20)
    dead.send(msg, "decode: not msgpack")
    dead.send(msg, "decode: not msgpack")  # the same record again, as after a restart before a checkpoint
    reader = make_consumer(kafka_cfg, "test", None, [dlq_topic])
    got = _poll_until(reader, 2)
    reader.close()
    producer.close()
    letters = [wire.decode(m.value, wire.DeadLetter) for m in got]
    assert {m.key for m in got} == {f"{topic}/0/0".encode()}  # one bad record, recognisable as one
    for d in letters:
        assert d.truncated and d.raw_size == len(big) and d.raw_sha256 == hashlib.sha256(big).hexdigest()
        assert 0 < len(d.raw) < 1 << 20 and big.startswith(d.raw)


def test_an_unknown_lag_is_none_not_a_crash() -> None:
    """The lag is a metric: when the broker does not answer (a restart), the caller keeps going without it."""
    from kafka.errors import KafkaTimeoutError

    from grpo_core.kafka_io import assigned_lag

    class Silent:
        def assignment(self) -> set[TopicPartition]:
            return {TopicPartition("t", 0)}

        def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
            raise KafkaTimeoutError("Failed to get offsets by times in 30000ms")

    assert assigned_lag(Silent()) is None  # type: ignore[arg-type]
    assert assigned_lag(Silent(), {0: 5}) is None  # type: ignore[arg-type]


def test_poll_through_a_broker_that_does_not_answer() -> None:
    """kafka-python lets a failed metadata refresh escape poll() mid-outage (a verifier died of it in the chaos
    run): a retriable error is an empty poll; anything else still raises."""
    from kafka.errors import KafkaConnectionError, UnknownMemberIdError

    from grpo_core.kafka_io import poll

    class Flaky:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def poll(self, timeout_ms: int, max_records: int | None = None) -> dict:
            raise self.error

    assert poll(Flaky(KafkaConnectionError("111 ECONNREFUSED")), 100) == {}  # type: ignore[arg-type]
    with pytest.raises(UnknownMemberIdError):
        poll(Flaky(UnknownMemberIdError()), 100)  # type: ignore[arg-type]


def test_acked_waits_on_a_pending_send_and_resends_a_failed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

    from grpo_core import kafka_io

    class Future:
        def __init__(self, outcomes: list[object]) -> None:
            self.outcomes, self.is_done = outcomes, False

        def get(self, timeout: float) -> object:
            out = self.outcomes.pop(0)
            if isinstance(out, Exception):
                self.is_done = not isinstance(out, KafkaTimeoutError) or out.args == ("failed",)
                raise out
            return out

    monkeypatch.setattr(kafka_io, "retry_delay", lambda attempt, backoff_s: 0.0)
    # Still pending twice (the wait timed out), then acked: the same future, nothing sent again.
    resent: list[int] = []
    future = Future([KafkaTimeoutError("wait"), KafkaTimeoutError("wait"), "meta"])
    assert kafka_io.acked(future, lambda: resent.append(1) or Future(["x"]), "t") == "meta" and not resent  # type: ignore
    # Failed by the client (delivery timeout): sent again, and the new send's ack is returned.
    failed = Future([KafkaTimeoutError("failed")])
    assert kafka_io.acked(failed, lambda: Future(["again"]), "t") == "again"  # type: ignore[arg-type]
    with pytest.raises(MessageSizeTooLargeError):  # not retriable: raises at once
        kafka_io.acked(Future([MessageSizeTooLargeError()]), lambda: Future(["x"]), "t")  # type: ignore[arg-type]


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_closing_a_producer_returns_through_a_broker_that_is_down(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A role stopping during an outage must not hang in its shutdown: kafka-python's close() waits forever for
    an unacknowledged record (and with a timeout raises, leaving its sender thread running). Through a live broker,
    close() still delivers what was sent."""
    from grpo_core import kafka_io

    broker = LocalBroker(data_dir=tmp_path / "kafka", port=free_port(), controller_port=free_port())
    broker.up(fresh=True)
    try:
        cfg = KafkaConfig(bootstrap=broker.bootstrap)
        _create_topic(broker.bootstrap, "closing")
        delivered = make_producer(cfg, "test", linger_ms=200)
        delivered.send("closing", value=b"sent, then closed")  # not waited for: close() must flush it
        delivered.close()
        consumer = make_consumer(cfg, "test", None, ["closing"])
        assert [m.value for m in _poll_until(consumer, 1)] == [b"sent, then closed"]
        consumer.close()

        stranded = make_producer(cfg, "test")
        stranded.send("closing", value=b"x").get(timeout=30)
        broker.down()
        pending = stranded.send("closing", value=b"never acknowledged")
        monkeypatch.setattr(kafka_io, "CLOSE_S", 2.0, raising=False)
        closer = threading.Thread(target=stranded.close, daemon=True)
        t0 = time.monotonic()
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() hung on a broker that is down"
        assert time.monotonic() - t0 < 30
        assert not stranded._sender.is_alive()  # no sender thread left behind, retrying forever
        assert pending.is_done and pending.failed()  # dropped, and said so to whoever holds the future
    finally:
        broker.down()


def test_an_outage_is_one_warning_and_one_info_however_many_calls_fail(caplog: pytest.LogCaptureFixture) -> None:
    """Before, every failed call logged a WARNING: 87-267 lines per role for a 3-10 s broker outage."""
    from kafka.errors import KafkaConnectionError, NodeNotReadyError

    from grpo_core.retry import Outage

    caplog.set_level(logging.DEBUG, logger="grpo_core.retry")
    outage = Outage("the broker at b:9092", warn_every_s=60.0, grace_s=0.0)
    for i in range(50):
        outage.failed(f"call {i}", KafkaConnectionError("111 ECONNREFUSED") if i % 2 else NodeNotReadyError(0))
    assert outage.down_since is not None
    outage.succeeded("commit")
    outage.succeeded("commit")  # nothing more to say
    above_debug = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert len(above_debug) == 2, above_debug
    assert above_debug[0][0] == "WARNING" and "the broker at b:9092 is not answering (call 0" in above_debug[0][1]
    assert above_debug[1][0] == "INFO" and re.search(r"answers again after \d+\.\ds \(50 failed calls\)",
                                                     above_debug[1][1])
    assert outage.down_since is None
    # A flap right after (a coordinator still loading) is not announced again within warn_every_s...
    caplog.clear()
    outage.failed("commit", KafkaConnectionError("x"))
    outage.succeeded("commit")
    assert [r for r in caplog.records if r.levelno > logging.DEBUG] == []
    # ...but a new outage once that has passed is.
    outage.warn_every_s = 0.0
    outage.failed("poll", KafkaConnectionError("y"))
    assert [r.levelname for r in caplog.records if r.levelno > logging.DEBUG] == ["WARNING"]


def test_a_failure_shorter_than_the_grace_is_not_announced(caplog: pytest.LogCaptureFixture) -> None:
    """A normal start: the broker's group coordinator is still loading for a second or two (FindCoordinator
    fails). That is at DEBUG, its end too; only an outage that lasts ``grace_s`` is a WARNING, saying how long."""
    from kafka.errors import CoordinatorNotAvailableError

    from grpo_core.retry import Outage

    caplog.set_level(logging.DEBUG, logger="grpo_core.retry")
    outage = Outage("the broker", grace_s=0.3)
    outage.failed("lag of demo.producers", CoordinatorNotAvailableError("loading"))
    outage.failed("lag of demo.producers", CoordinatorNotAvailableError("loading"))
    outage.succeeded("lag of demo.producers")
    assert [r for r in caplog.records if r.levelno > logging.DEBUG] == []
    outage.failed("poll", CoordinatorNotAvailableError("loading"))
    time.sleep(0.35)
    outage.failed("poll", CoordinatorNotAvailableError("loading"))
    outage.succeeded("poll")
    loud = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert [level for level, _ in loud] == ["WARNING", "INFO"], loud
    assert re.search(r"not answering \(poll: .*CoordinatorNotAvailableError.*; for 0\.[3-9]s\)", loud[0][1]), loud


def test_an_outage_that_outlasts_the_grace_between_failures_is_said_on_time(
        caplog: pytest.LogCaptureFixture) -> None:
    """Calls back off (or block) through an outage: the last failure may come before the grace is over. The
    outage lasts longer all the same: its WARNING comes when the grace is over, naming the last failure."""
    from kafka.errors import KafkaConnectionError

    from grpo_core.retry import Outage

    caplog.set_level(logging.DEBUG, logger="grpo_core.retry")
    outage = Outage("the broker", grace_s=0.2)
    outage.failed("poll", KafkaConnectionError("111 ECONNREFUSED"))
    time.sleep(0.7)  # no call fails meanwhile: the outage's timer says it once the grace is over
    outage.succeeded("poll")
    loud = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert [level for level, _ in loud] == ["WARNING", "INFO"], loud
    assert re.match(r"the broker is not answering \(poll: .*ECONNREFUSED; for 0\.[2-6]s\)", loud[0][1]), loud
    assert re.match(r"the broker answers again after 0\.[7-9]s \(1 failed calls\)", loud[1][1]), loud


def test_a_broker_calls_retries_through_an_outage_are_the_outages_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    """with_retry (connect, metadata, offsets): an outage goes to the process's one tracker; any other failure (a
    topic not created yet) is the call's own, a WARNING per retry as for every retried I/O call."""
    from kafka.errors import KafkaConnectionError, UnknownTopicOrPartitionError

    from grpo_core import kafka_connect
    from grpo_core.retry import Outage

    def fails_4_times(error: Exception) -> Callable[[], str]:
        calls: list[int] = []

        def call() -> str:
            calls.append(1)
            if len(calls) < 5:
                raise error
            return "ok"
        return call

    caplog.set_level(logging.DEBUG, logger="grpo_core.retry")
    original, kafka_connect.BROKER = kafka_connect.BROKER, Outage("the broker", grace_s=0.0)
    try:
        for error in (KafkaConnectionError("111 ECONNREFUSED"), UnknownTopicOrPartitionError("t")):
            assert kafka_connect.with_retry(fails_4_times(error), "metadata", attempts=5, backoff_s=0.001) == "ok"
    finally:
        kafka_connect.BROKER = original
    lines = [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno > logging.DEBUG]
    expected = [r"WARNING the broker is not answering \(metadata: KafkaConnectionError: 111 ECONNREFUSED; for",
                r"INFO the broker answers again after [\d.]+s \(4 failed calls\)",
                *[rf"WARNING metadata failed \(.*UnknownTopicOrPartitionError: t\); retry {i}/4 in"
                  for i in range(1, 5)],
                r"INFO metadata succeeded after 4 failed attempt\(s\)"]
    assert len(lines) == len(expected), lines
    assert all(re.match(e, line) for e, line in zip(expected, lines, strict=True)), lines


def test_retry_stops_at_its_deadline() -> None:
    from grpo_core.retry import retry

    t0 = time.monotonic()
    with pytest.raises(OSError):
        retry(lambda: (_ for _ in ()).throw(OSError("down")), "x", attempts=1000, backoff_s=0.2,
              transient=(OSError,), until=time.monotonic() + 1.0)
    assert 0.9 < time.monotonic() - t0 < 3.0


def test_poll_failures_in_an_outage_are_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    from kafka.errors import KafkaConnectionError

    from grpo_core import kafka_io
    from grpo_core.retry import Outage

    class Down:
        def poll(self, timeout_ms: int, max_records: int | None = None) -> dict:
            raise KafkaConnectionError("111 ECONNREFUSED")

    caplog.set_level(logging.INFO)
    outage = Outage("the broker", grace_s=0.0)
    original, kafka_io.BROKER = kafka_io.BROKER, outage
    try:
        for _ in range(5):
            assert kafka_io.poll(Down(), 1) == {}  # type: ignore[arg-type]
    finally:
        kafka_io.BROKER = original
    assert [r.levelname for r in caplog.records if r.levelno >= logging.INFO] == ["WARNING"]


def test_a_closed_port_is_broker_unreachable_after_connect_timeout() -> None:
    """Before: ten bootstrap attempts of 30 s each plus backoff, ~6 minutes, then KafkaTimeoutError."""
    from grpo_core.config import InputError
    from grpo_core.kafka_io import BrokerError, BrokerUnreachable, make_admin, make_consumer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        bootstrap = f"127.0.0.1:{s.getsockname()[1]}"
        cfg = KafkaConfig(bootstrap=bootstrap, connect_timeout_s=2.0)
        for make in (make_admin, lambda c: make_consumer(c, "test", None)):
            t0 = time.monotonic()
            with pytest.raises(BrokerUnreachable) as info:
                make(cfg)
            assert 1.5 < time.monotonic() - t0 < 15
            assert f"no Kafka broker answered at {bootstrap} within 2s" in str(info.value)
            assert "\n" not in str(info.value)
            # bad input at the CLI; to the code that waits out outages, still a broker timeout
            assert isinstance(info.value, InputError) and isinstance(info.value, BrokerError)
