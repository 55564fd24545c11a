"""Tests for grpo_stream.broker: each integration test starts its own broker on free ports in tmp_path."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo_stream.broker import (
    JVM_PERF_ENV,
    BrokerError,
    LocalBroker,
    free_port,
    jvm_performance_opts,
    new_cluster_id,
    parse_java_major,
)

TOPIC = "persist-me"
GROUP = "persist-group"


def _pids_with(text: str) -> list[int]:
    """Every live process whose command line mentions text (zombies have an empty cmdline)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _ports() -> tuple[int, int]:
    port = free_port()
    controller = free_port()
    while controller == port:
        controller = free_port()
    return port, controller


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    port, controller = _ports()
    b = LocalBroker(data_dir=tmp_path / "kafka", port=port, controller_port=controller)
    try:
        yield b
    finally:
        b.down()


# ---- no broker needed ------------------------------------------------------------------------------


def test_parse_java_major() -> None:
    assert parse_java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert parse_java_major('java version "1.8.0_292"') == 8
    assert parse_java_major('openjdk version "21" 2023-09-19') == 21
    assert parse_java_major("garbage") is None


def test_cluster_id_shape() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_free_port_is_bindable() -> None:
    ports = {free_port() for _ in range(5)}
    assert all(1024 < port < 65536 for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if another socket holds it
            assert s.getsockname()[1] == port


def test_missing_jars_says_run_setup(tmp_path: Path) -> None:
    empty = tmp_path / "libs"
    empty.mkdir()
    b = LocalBroker(data_dir=tmp_path / "kafka", port=free_port(), libs_dir=empty)
    with pytest.raises(BrokerError, match=r"ops/setup\.sh"):
        b.up(timeout_s=5)
    assert b.status() == {"running": False, "bootstrap": b.bootstrap, "pid": None, "version": None}


def test_missing_java_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    b = LocalBroker(data_dir=tmp_path / "kafka", port=free_port())
    with pytest.raises(BrokerError, match=r"Java >= 17"):
        b.up(timeout_s=5)


def test_port_taken(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        b = LocalBroker(data_dir=tmp_path / "kafka", port=port, controller_port=free_port())
        with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{port}.*--port"):
            b.up(timeout_s=10)
    assert not _pids_with(str(tmp_path))


def test_foreign_cluster_id(tmp_path: Path) -> None:
    # Both ports picked free: the default controller port (port + 1) may be a client's source port meanwhile.
    port = free_port()
    b = LocalBroker(data_dir=tmp_path / "kafka", port=port,
                    controller_port=next(c for c in iter(free_port, None) if c != port))
    cluster_id = b.prepare()  # formats the storage with the real StorageTool
    meta = (b.kraft_dir / "meta.properties").read_text()
    assert f"cluster.id={cluster_id}" in meta
    assert b.prepare() == cluster_id  # already formatted: kept as is
    other = new_cluster_id()
    b.cluster_id_file.write_text(other + "\n")
    with pytest.raises(BrokerError, match=rf"belongs to cluster {cluster_id}, not {other}.*--fresh"):
        b.up(timeout_s=10)
    assert not _pids_with(str(tmp_path))
    assert b.prepare(fresh=True) != cluster_id


def test_fresh_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("do not delete")
    b = LocalBroker(data_dir=tmp_path, port=free_port())
    with pytest.raises(BrokerError, match="refusing to wipe"):
        b.prepare(fresh=True)
    assert (tmp_path / "precious.txt").exists()


def test_the_jvm_options_default_to_c1_and_the_serial_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_stream.kafka_tools import tool_command

    monkeypatch.delenv(JVM_PERF_ENV, raising=False)
    assert jvm_performance_opts() == ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    monkeypatch.setenv(JVM_PERF_ENV, "  ")  # blank: the defaults, not an empty JVM option
    assert jvm_performance_opts() == ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    monkeypatch.setenv(JVM_PERF_ENV, "-XX:+UseG1GC  -XX:MaxGCPauseMillis=20")
    assert jvm_performance_opts() == ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"]
    cmd = tool_command("topics", ["--list"], str(Path(".cache/kafka/libs")), "127.0.0.1:1")
    assert cmd[1:3] == ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"]


# ---- real brokers ----------------------------------------------------------------------------------


def _jvm_threads(pid: int) -> set[str]:
    names = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.add((task / "comm").read_text().strip())
    return names


@pytest.mark.integration
@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_the_broker_runs_without_the_c2_compiler_unless_told_to(
        broker: LocalBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling took nearly half of a pipeline broker's CPU, C2 most of it (docs/getting-started.md, "The local
    broker"): the broker's JVM has no C2 compiler thread and no G1 threads; $KAFKA_JVM_PERFORMANCE_OPTS brings them
    back."""
    monkeypatch.delenv(JVM_PERF_ENV, raising=False)
    threads = _jvm_threads(broker.up(fresh=True)["pid"])
    assert any(t.startswith("C1 Compiler") for t in threads), sorted(threads)
    assert not any(t.startswith(("C2 Compiler", "G1 ")) for t in threads), sorted(threads)
    broker.down()
    monkeypatch.setenv(JVM_PERF_ENV, "-XX:+UseG1GC")
    threads = _jvm_threads(broker.up()["pid"])
    assert any(t.startswith("C2 Compiler") for t in threads), sorted(threads)
    assert any(t.startswith("G1 ") for t in threads), sorted(threads)


@pytest.mark.integration
def test_up_twice_status_down(broker: LocalBroker) -> None:
    state = broker.up()
    pid = state["pid"]
    assert state["bootstrap"] == broker.bootstrap == f"127.0.0.1:{broker.port}"
    assert state["cluster_id"] == broker.cluster_id_file.read_text().strip()

    # A second `up` (even from another LocalBroker object, as a second CLI call would be) is a no-op.
    again = LocalBroker(broker.data_dir, port=broker.port, controller_port=broker.controller_port).up()
    assert again["pid"] == pid

    st = broker.status()
    assert st["running"] is True and st["pid"] == pid and st["bootstrap"] == broker.bootstrap
    assert st["version"].startswith("4.3.")
    assert set(st) == {"running", "bootstrap", "pid", "version"}

    with pytest.raises(BrokerError, match="already running.*kafka down"):
        LocalBroker(broker.data_dir, port=free_port()).up()

    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=5000)
    try:
        assert admin.describe_cluster()["brokers"]
    finally:
        admin.close()

    assert broker.down() is True
    assert not Path(f"/proc/{pid}").exists()
    assert not _pids_with(str(broker.data_dir))
    assert broker.status() == {
        "running": False,
        "bootstrap": broker.bootstrap,
        "pid": None,
        "version": st["version"],
    }
    assert broker.down() is False  # harmless when nothing runs


def _produce_and_commit(bootstrap: str, n: int) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    try:
        admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(n):
        producer.send(TOPIC, value=f"record-{i}".encode())
    producer.flush(timeout=30)
    producer.close()
    # Commit with a manual assignment: persists the group's offset without waiting for a rebalance.
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False)
    try:
        tp = TopicPartition(TOPIC, 0)
        consumer.assign([tp])
        consumer.seek(tp, n)
        consumer.commit()
    finally:
        consumer.close()


def _group_offsets(admin: Any) -> dict[Any, Any]:
    """The group's committed offsets. Right after a restart the broker answers CoordinatorLoadInProgress until it
    has loaded __consumer_offsets (a CI run failed on that); wait for it through the services' own retry."""
    from kafka.errors import CoordinatorLoadInProgressError, CoordinatorNotAvailableError

    from grpo_core.retry import retry

    return retry(lambda: admin.list_group_offsets({GROUP: None}).get(GROUP, {}), "group offsets", attempts=9,
                 backoff_s=0.5, transient=(CoordinatorLoadInProgressError, CoordinatorNotAvailableError))


def _read_back(bootstrap: str) -> tuple[set[str], list[bytes], int | None]:
    from kafka import KafkaConsumer, TopicPartition
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    try:
        topics = set(admin.list_topics())
        committed = None
        if TOPIC in topics:
            offsets = _group_offsets(admin)
            meta = offsets.get(TopicPartition(TOPIC, 0))
            committed = meta.offset if meta is not None else None
    finally:
        admin.close()
    values: list[bytes] = []
    if TOPIC in topics:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=5000)
        try:
            tp = TopicPartition(TOPIC, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            for msg in consumer:
                values.append(msg.value)
                if len(values) >= 10:
                    break
        finally:
            consumer.close()
    return topics, values, committed


@pytest.mark.integration
@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_restart_keeps_data_and_fresh_wipes_it(broker: LocalBroker) -> None:
    first = broker.up()
    _produce_and_commit(broker.bootstrap, 10)
    assert broker.down()

    # Restart on other ports: server.properties is rewritten, the formatted storage is kept.
    port, controller = _ports()
    moved = LocalBroker(broker.data_dir, port=port, controller_port=controller)
    try:
        second = moved.up()
        assert second["cluster_id"] == first["cluster_id"] and second["port"] == port
        topics, values, committed = _read_back(moved.bootstrap)
        assert TOPIC in topics
        assert values == [f"record-{i}".encode() for i in range(10)]
        assert committed == 10
        assert moved.down()

        third = moved.up(fresh=True)
        assert third["cluster_id"] != first["cluster_id"]
        topics, _, _ = _read_back(moved.bootstrap)
        assert TOPIC not in topics
    finally:
        moved.down()
    assert not _pids_with(str(broker.data_dir))
    assert os.path.exists(broker.data_dir / "logs" / "server.log")
