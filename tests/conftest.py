"""Shared fixtures. The session broker is a real Apache Kafka (KRaft) on loopback, started on free ports in a
temporary directory -- unless ``KAFKA_BOOTSTRAP`` points at an external cluster, which is then used as is."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient

from grpo_core.config import KafkaConfig
from grpo_core.contract import PipelineContract
from grpo_core.topics import ensure_topics
from grpo_stream.broker import LocalBroker, free_port
from grpo_verifiers.config import VerifierConfig
from grpo_verifiers.service import Verifier


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    port = free_port()
    controller = free_port()
    while controller == port:
        controller = free_port()
    broker = LocalBroker(data_dir=tmp_path_factory.mktemp("kafka"), port=port, controller_port=controller)
    state = broker.up(fresh=True)
    try:
        yield state["bootstrap"]
    finally:
        broker.down()


@pytest.fixture
def kafka_cfg(kafka_bootstrap: str) -> KafkaConfig:
    return KafkaConfig(bootstrap=kafka_bootstrap)


@pytest.fixture
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def new_topic(admin: KafkaAdminClient) -> Callable[..., str]:
    """Create a uniquely named topic (tests never share topics, so they can run in any order)."""

    def make(prefix: str = "t", partitions: int = 1, configs: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics({name: {"num_partitions": partitions, "replication_factor": 1,
                                    "configs": configs or {}}})
        admin.wait_for_topics([name], timeout_ms=30_000)
        return name

    return make


@pytest.fixture
def unique() -> Callable[[str], str]:
    return lambda prefix: f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def plan(admin: KafkaAdminClient, unique: Callable[[str], str]) -> PipelineContract:
    """A pipeline contract of a run of its own (so its topics and consumer groups are unique), its topics created
    on the session broker."""
    plan = PipelineContract(run=unique("plan"))
    ensure_topics(admin, plan)
    return plan


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that use the broker are integration tests, whether or not they say so.
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def running() -> Iterator[Callable[[VerifierConfig], Verifier]]:
    """Start verifiers in threads of this process; each is stopped and closed at the end of the test."""
    started: list[tuple[Verifier, threading.Thread]] = []

    def start(cfg: VerifierConfig) -> Verifier:
        v = Verifier(cfg)
        t = threading.Thread(target=v.run, daemon=True)
        t.start()
        started.append((v, t))
        return v

    yield start
    for v, t in started:
        v.stopping = True
        t.join(timeout=60)
        v.close()
