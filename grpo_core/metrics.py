"""The per-process HTTP endpoint: ``/metrics`` (Prometheus text format) and ``/health`` (JSON).

Each role declares its metrics in one small module of its own, on its own :class:`CollectorRegistry`, and
serves them with :class:`MetricsServer`; the math never calls into metrics. Names follow Prometheus
conventions: ``grpo_stream_<role>_<what>_<unit>`` with ``_total``, ``_seconds``, ``_bytes`` suffixes.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from grpo_core.config import ConfigError, MetricsConfig

log = logging.getLogger(__name__)
M = TypeVar("M", bound=MetricWrapperBase)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]
Route = Callable[[], tuple[str, bytes]]  # an extra GET path's (content type, body)

# The dead-letter reason grpo_core itself produces (kafka_io.DeadLetters.decode_or_reason); the roles add theirs.
DECODE = "decode"


def role_registry() -> CollectorRegistry:
    """A process's own registry, with the ``process_*`` (CPU, memory, fds, start time) and ``python_info``
    series the default registry would have carried: a restart shows as a new ``process_start_time_seconds``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def init_series(metric: M, values: Iterable[str | tuple[str, ...]]) -> M:
    """Create the labelled series of ``metric`` for every known label value (a tuple for several labels), at 0.
    A labelled series only exists after its first use otherwise, and ``rate()``/``increase()`` never count the
    events that created it: a first burst of dead letters would be invisible."""
    for v in values:
        metric.labels(*((v,) if isinstance(v, str) else v))
    return metric


def dead_letter_counter(registry: CollectorRegistry, role: str, reasons: Iterable[str]) -> Counter:
    """Every role counts the records it sent to the dlq, by reason class (e.g. ``decode``), with a series for
    each of its known ``reasons`` from the start. A process counter, as Prometheus counters are: it starts at 0
    with the process, and ``rate()``/``increase()`` handle the reset. The dlq topic is the durable record (one
    key per bad source record: count distinct keys for totals)."""
    counter = Counter(f"grpo_stream_{role}_dead_letters_total",
                      "Records this process wrote to the dlq topic (reset on restart; the dlq topic keeps them all)",
                      ["reason"], registry=registry)
    return init_series(counter, sorted({DECODE, *reasons}))


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
    """Serves a registry on ``host:port`` from a daemon thread; ``port=0`` picks a free port. ``setting`` is the
    config key of the port, for the error when it cannot be bound; ``routes`` are extra GET paths."""

    def __init__(self, registry: CollectorRegistry, cfg: MetricsConfig,
                 health: HealthFn = lambda: (True, {}), setting: str = "metrics.port",
                 routes: dict[str, Route] | None = None) -> None:
        self.registry, self.cfg, self.health, self.setting = registry, cfg, health, setting
        self.routes = routes or {}
        self._server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server else None

    def start(self) -> MetricsServer:
        if self.cfg.port < 0:
            return self
        handler = _make_handler(self.registry, self.health, self.routes)
        try:
            self._server = ThreadingHTTPServer((self.cfg.host, self.cfg.port), handler)
        except OSError as exc:
            raise ConfigError(self._bind_error(exc)) from None
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics (health: /health)", self.cfg.host, self.port)
        return self

    def _bind_error(self, exc: OSError) -> str:
        where = f"{self.setting} {self.cfg.port} on {self.cfg.host}"
        if exc.errno == errno.EADDRINUSE:
            return (f"{where}: address already in use (another process? set {self.setting} to a free port, or 0 "
                    "for any)")
        if exc.errno == errno.EACCES:
            return f"{where}: permission denied (ports below 1024 need privileges; set {self.setting})"
        host_key = self.setting.replace("port", "host")
        return f"{where}: cannot listen: {exc.strerror or exc} (check {host_key} and {self.setting})"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _make_handler(registry: CollectorRegistry, health: HealthFn,
                  routes: dict[str, Route]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def handle(self) -> None:
            # A client that hangs up mid-reply (a scrape timing out, a process stopping) is not an error here.
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

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
            elif path in routes:
                self._reply(200, *routes[path]())
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
