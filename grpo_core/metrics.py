"""The per-process HTTP endpoint: ``/metrics`` (Prometheus text format) and ``/health`` (JSON).

Each role declares its metrics in one small module of its own, on its own :class:`CollectorRegistry`, and
serves them with :class:`MetricsServer`; the math never calls into metrics. Names follow Prometheus
conventions: ``grpo_stream_<role>_<what>_<unit>`` with ``_total``, ``_seconds``, ``_bytes`` suffixes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from grpo_core.config import MetricsConfig

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


def dead_letter_counter(registry: CollectorRegistry, role: str) -> Counter:
    """Every role counts the records it sent to the dlq, by reason class (e.g. ``decode``). A process counter,
    as Prometheus counters are: it starts at 0 with the process, and ``rate()``/``increase()`` handle the reset.
    The dlq topic is the durable record (one key per bad source record: count distinct keys for totals)."""
    return Counter(f"grpo_stream_{role}_dead_letters_total",
                   "Records this process wrote to the dlq topic (reset on restart; the dlq topic keeps them all)",
                   ["reason"], registry=registry)


class Liveness:
    """``/health`` as progress, not mere presence: unhealthy while work waits and nothing progressed for
    ``stall_s``. The service's loop calls :meth:`progressed` after durable work and sets :attr:`waiting` when it
    holds partitions with records it has not processed (the health probe runs on another thread and must not touch
    Kafka clients). This also catches a consumer the client library left wedged in a group it no longer serves."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s, self.clock = stall_s, clock
        self.last_progress, self.waiting = clock(), False

    def progressed(self) -> None:
        self.last_progress = self.clock()

    def check(self) -> tuple[bool, dict[str, Any]]:
        idle = self.clock() - self.last_progress
        stalled = self.stall_s > 0 and self.waiting and idle >= self.stall_s
        return not stalled, {"waiting": self.waiting, "idle_s": round(idle, 1), "stalled": stalled}


class MetricsServer:
    """Serves a registry on ``host:port`` from a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, registry: CollectorRegistry, cfg: MetricsConfig,
                 health: HealthFn = lambda: (True, {})) -> None:
        self.registry, self.cfg, self.health = registry, cfg, health
        self._server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server else None

    def start(self) -> MetricsServer:
        if self.cfg.port < 0:
            return self
        handler = _make_handler(self.registry, self.health)
        self._server = ThreadingHTTPServer((self.cfg.host, self.cfg.port), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics (health: /health)", self.cfg.host, self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _make_handler(registry: CollectorRegistry, health: HealthFn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/health":
                try:
                    ok, detail = health()
                except Exception as exc:  # a failing probe is an unhealthy process, not a crashed server
                    ok, detail = False, {"error": f"{type(exc).__name__}: {exc}"}
                body = json.dumps({"status": "ok" if ok else "unhealthy", **detail}, default=str).encode()
                self._reply(200 if ok else 503, "application/json", body)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /health\n")

        def _reply(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- scrapes are not news
            pass

    return Handler
