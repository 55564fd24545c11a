"""Secured clusters against the real broker in its secured test mode (``grpo_stream.broker_security``): records
pass through a SASL/SCRAM-SHA-512 listener, plain and over TLS with a generated CA, with the password taken
from the environment; a wrong password fails fast, naming the listener and the mechanism; no secret reaches a
resolved config or the logged client settings."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kafka.admin import NewTopic

from grpo_core.config import ConfigError, KafkaConfig, to_dict
from grpo_core.kafka_io import BrokerLoginError, client_settings, make_admin, make_consumer, make_producer, redacted
from grpo_stream.broker import LocalBroker, free_port
from grpo_stream.broker_security import BrokerSecurity

pytestmark = pytest.mark.slow
PASSWORD = "trainer-pw-7"
ENV = "GRPO_TEST_KAFKA_PASSWORD"


@pytest.fixture(scope="module", params=["SASL_PLAINTEXT", "SASL_SSL"])
def secured(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[LocalBroker, BrokerSecurity]]:
    root = tmp_path_factory.mktemp(request.param.lower())
    security = BrokerSecurity({"broker": "broker-pw-1", "trainer": PASSWORD},
                              tls_dir=root / "tls" if request.param == "SASL_SSL" else None)
    broker = LocalBroker(data_dir=root / "kafka", port=free_port(), controller_port=free_port(), security=security)
    broker.up(fresh=True)
    try:
        yield broker, security
    finally:
        broker.down()


def login(broker: LocalBroker, security: BrokerSecurity, monkeypatch: pytest.MonkeyPatch,
          password: str) -> KafkaConfig:
    monkeypatch.setenv(ENV, password)
    return KafkaConfig(bootstrap=broker.bootstrap, security_protocol=security.protocol,  # type: ignore[arg-type]
                       sasl_mechanism="SCRAM-SHA-512", sasl_username="trainer", sasl_password_env=ENV,
                       ssl_cafile=str(security.ca_file) if security.ca_file else None)


def test_records_pass_through_the_secured_listener(secured: tuple[LocalBroker, BrokerSecurity],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    broker, security = secured
    cfg = login(broker, security, monkeypatch, PASSWORD)
    admin = make_admin(cfg, "test")
    admin.create_topics([NewTopic("secured", 1, 1)])
    admin.close()
    producer = make_producer(cfg, "test")
    producer.send("secured", key=b"k", value=b"through " + security.protocol.encode()).get(timeout=30)
    producer.close()
    consumer = make_consumer(cfg, "test", "secured-readers", ["secured"])
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        got += [m.value for msgs in consumer.poll(timeout_ms=500).values() for m in msgs]
    consumer.close()
    assert got == [b"through " + security.protocol.encode()]
    # The password reaches the client from the environment and nowhere else a user would look.
    assert client_settings(cfg, "test")["sasl_plain_password"] == PASSWORD
    assert PASSWORD not in str(redacted(client_settings(cfg, "test")))
    assert PASSWORD not in yaml.safe_dump(to_dict(cfg))


@pytest.fixture
def kafka_logs_at_critical() -> Iterator[None]:
    """As in every process the CLI starts: kafka-python's loggers at CRITICAL (a refused login is still caught)."""
    kafka_log = logging.getLogger("kafka")
    old = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    yield
    kafka_log.setLevel(old)


def test_a_wrong_password_fails_fast_naming_the_listener_and_mechanism(
        secured: tuple[LocalBroker, BrokerSecurity], monkeypatch: pytest.MonkeyPatch,
        kafka_logs_at_critical: None) -> None:
    broker, security = secured
    cfg = login(broker, security, monkeypatch, "not-the-password")
    # Three tries of each client: the broker answers a refused login and closes the connection together, and
    # a client that lost the answer (kafka_patches._read_from_sock) retried it as an outage for 1-30 s.
    for make in 3 * (lambda: make_producer(cfg, "learner"), lambda: make_consumer(cfg, "learner", "g", []),
                     lambda: make_admin(cfg, "learner")):
        t0 = time.monotonic()
        with pytest.raises(BrokerLoginError) as info:
            make()
        assert time.monotonic() - t0 < 4, "a refused login must not be retried like an outage"
        message = str(info.value)
        for fragment in (broker.bootstrap, f"listener {security.protocol}", "mechanism SCRAM-SHA-512",
                         "user 'trainer'", f"${ENV}"):
            assert fragment in message, (fragment, message)
        assert "not-the-password" not in message and isinstance(info.value, ConfigError)


def test_a_missing_password_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match=f"environment variable {ENV} is not set"):
        KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                    sasl_password_env=ENV).validate()
