"""What every service process does around its loop: serve /metrics and /health, turn SIGTERM/SIGINT into a
graceful stop (finish the unit of work in hand, make it durable), and always close clients and the endpoint."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from grpo_stream.config import MetricsConfig
from grpo_stream.metrics import HealthFn, MetricsServer

log = logging.getLogger(__name__)


def serve(registry: CollectorRegistry, metrics: MetricsConfig, health: HealthFn, run: Callable[[], object],
          stop: Callable[[], None], close: Callable[[], None], on_stop: str) -> int:
    """Run ``run()`` with the metrics endpoint up; a signal calls ``stop()`` (``on_stop`` says what it will do)."""
    server = MetricsServer(registry, metrics, health=health).start()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: %s", signum, on_stop)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run()
    finally:
        close()
        server.stop()
    return 0
