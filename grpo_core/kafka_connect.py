"""How every client reaches the broker: its settings, the bounded wait for a broker at start-up, and the one
outage tracker per process (part of the seam to the Kafka client, with :mod:`grpo_core.kafka_io`, which
re-exports what the rest of the code base uses).

* :func:`connect` makes a new client, retried while no broker answers, for at most ``kafka.connect_timeout_s``;
  then :class:`BrokerUnreachable`, one line naming the address (exit 2 at the CLI). A refused login fails at once
  (:class:`BrokerLoginError`).
* :data:`BROKER` hears of every broker call that failed because the broker does not answer, and of successes: one
  WARNING when an outage begins, DEBUG for the calls that fail during it, one INFO with its length when the broker
  answers again (:class:`grpo_core.retry.Outage`). kafka-python's own loggers stay below that: the CLI sets them
  to ERROR (``GRPO_STREAM_KAFKA_LOG_LEVEL``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kafka.errors import (
    IllegalSaslStateError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailedError,
    UnknownTopicOrPartitionError,
    UnsupportedSaslMechanismError,
)

from grpo_core.config import ConfigError, InputError, KafkaConfig
from grpo_core.retry import CallLog, Outage, describe, retry

T = TypeVar("T")

BROKER = Outage("the broker")  # every broker call of this process reports here (named after its bootstrap)


def is_outage(exc: BaseException) -> bool:
    """Whether a failed broker call means that the broker does not answer (as opposed to a topic that does not
    exist, or a request the broker refused)."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, KafkaError) and exc.retriable and not isinstance(exc, UnknownTopicOrPartitionError)


class _BrokerCallLog(CallLog):
    """One broker call's retries: an outage goes to :data:`BROKER`, anything else is logged as the call's own."""

    def failed(self, what: str, exc: BaseException, attempt: int, attempts: int, retry_in_s: float) -> None:
        if is_outage(exc):
            BROKER.failed(what, exc)
        else:
            super().failed(what, exc, attempt, attempts, retry_in_s)

    def succeeded(self, what: str) -> None:
        BROKER.succeeded(what)
        super().succeeded(what)


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


class BrokerUnreachable(InputError, KafkaTimeoutError):  # type: ignore[misc]  # kafka-python has no type hints
    """No broker answered a new client within ``kafka.connect_timeout_s``: a wrong address or a broker that is
    down. A KafkaTimeoutError to the code that waits out outages, one line and exit 2 at the CLI."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else type(self).__name__


class _RefusedLoginEndsBootstrap(logging.Filter):
    """kafka-python's bootstrap loop catches a refused SASL login, logs it and tries again until its
    ``bootstrap_timeout_ms``; then :func:`connect` would start it over: a wrong password would pass for a
    broker outage. The loop logs the error object as an argument of that warning; raising it from the log call
    ends the loop at once (:func:`connect` turns it into :class:`BrokerLoginError`). ``tests/test_security.py``
    holds the pinned kafka-python to this. The logger must let WARNINGs through for that, so this filter drops
    what the ``kafka`` logger's level would have (the bootstrap loop's warnings during an outage)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for arg in record.args if isinstance(record.args, tuple) else ():
            if isinstance(arg, LOGIN_ERRORS):
                raise arg
        return record.levelno >= logging.getLogger("kafka").getEffectiveLevel()


_bootstrap_log = logging.getLogger("kafka.net.manager")
_bootstrap_log.addFilter(_RefusedLoginEndsBootstrap())
# A filter only sees records its logger lets through: this logger's own level stays WARNING whatever the CLI sets
# on ``kafka`` later (CRITICAL by default), and the filter applies that level instead. Its DEBUG/INFO lines are
# not shown even with $GRPO_STREAM_KAFKA_LOG_LEVEL=DEBUG: letting them through would create a record per call
# of the client's network loop.
_bootstrap_log.setLevel(logging.WARNING)


def with_retry(fn: Callable[[], T], what: str, attempts: int = 10, backoff_s: float = 0.5,
               until: float | None = None) -> T:
    """Retry a broker call (connect, metadata, offsets) with exponential backoff (:func:`grpo_core.retry.retry`;
    ``until``: a time.monotonic() deadline). kafka-python 3 raises KafkaError subclasses when no broker answers,
    OSError for socket failures; a refused login is raised at once. Outages are reported to :data:`BROKER`."""
    return retry(fn, what, attempts=attempts, backoff_s=backoff_s, transient=(KafkaError, OSError),
                 fatal=LOGIN_ERRORS, until=until, log_to=_BrokerCallLog())


def connect(make: Callable[[float], T], cfg: KafkaConfig, role: str, what: str) -> T:
    """A new client (``make`` gets the seconds its bootstrap may wait), retried while no broker answers, for at
    most ``kafka.connect_timeout_s``; then :class:`BrokerUnreachable`. A refused login fails fast."""
    bootstrap = cfg.resolved_bootstrap()
    BROKER.name = f"the broker at {bootstrap}"
    until = time.monotonic() + cfg.connect_timeout_s
    try:
        return with_retry(lambda: make(max(1.0, until - time.monotonic())), f"{role}: connect {what}",
                          attempts=1 << 30, until=until)
    except LOGIN_ERRORS as exc:
        password = f"the password in ${cfg.sasl_password_env}" if cfg.sasl_password_env else "no password set"
        raise BrokerLoginError(
            f"{role}: the broker at {bootstrap} refused the login of {what} (listener "
            f"{cfg.security_protocol}, mechanism {cfg.sasl_mechanism}, user {cfg.sasl_username!r}): "
            f"{type(exc).__name__}: {exc}. Check kafka.sasl_username and {password}") from None
    except (KafkaError, OSError) as exc:
        if not is_outage(exc):
            raise
        raise BrokerUnreachable(
            f"no Kafka broker answered at {bootstrap} within {cfg.connect_timeout_s:g}s (kafka.connect_timeout_s; "
            f"the {role} {what}'s last error: {describe(exc)}); check that the broker is up "
            f"and that kafka.bootstrap (or $KAFKA_BOOTSTRAP) names it") from None

