"""The per-process /metrics and /health endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from grpo_core.config import MetricsConfig
from grpo_core.metrics import MetricsServer, dead_letter_counter


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_metrics_and_health_endpoints() -> None:
    registry = CollectorRegistry()
    steps = Counter("grpo_stream_test_steps_total", "steps", registry=registry)
    dead = dead_letter_counter(registry, "test", ["bad_thing"])
    steps.inc(3)
    dead.labels(reason="decode").inc()
    healthy = {"ok": True}
    server = MetricsServer(registry, MetricsConfig(port=0),
                           health=lambda: (healthy["ok"], {"step": 3})).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        code, body = _get(base + "/metrics")
        assert code == 200
        text = body.decode()
        assert "grpo_stream_test_steps_total 3.0" in text
        assert 'grpo_stream_test_dead_letters_total{reason="decode"} 1.0' in text
        assert 'grpo_stream_test_dead_letters_total{reason="bad_thing"} 0.0' in text  # before its first use
        code, body = _get(base + "/health")
        assert code == 200 and json.loads(body) == {"status": "ok", "step": 3}
        healthy["ok"] = False
        code, body = _get(base + "/health")
        assert code == 503 and json.loads(body)["status"] == "unhealthy"
        assert _get(base + "/nope")[0] == 404
    finally:
        server.stop()


def test_failing_health_probe_reports_unhealthy_instead_of_crashing() -> None:
    def boom() -> tuple[bool, dict]:
        raise RuntimeError("consumer thread died")

    server = MetricsServer(CollectorRegistry(), MetricsConfig(port=0), health=boom).start()
    try:
        code, body = _get(f"http://127.0.0.1:{server.port}/health")
        assert code == 503 and "consumer thread died" in json.loads(body)["error"]
    finally:
        server.stop()


def test_disabled_endpoint_binds_nothing() -> None:
    server = MetricsServer(CollectorRegistry(), MetricsConfig(port=-1)).start()
    assert server.port is None


@pytest.mark.parametrize("port", [-2, 70000])
def test_metrics_port_is_validated(port: int) -> None:
    from grpo_core.config import ConfigError

    with pytest.raises(ConfigError, match="metrics.port"):
        MetricsConfig(port=port).validate()


def test_liveness_is_progress_not_presence() -> None:
    from grpo_core.metrics import Liveness

    now = [0.0]
    live = Liveness(stall_s=60.0, clock=lambda: now[0])
    now[0] = 500.0
    assert live.check()[0]  # idle, but nothing waits: healthy
    live.waiting = True
    ok, detail = live.check()
    assert not ok and detail == {"waiting": True, "idle_s": 500.0, "stalled": True}
    live.progressed()
    now[0] = 559.0
    assert live.check()[0]
    now[0] = 560.0
    assert not live.check()[0]
    assert Liveness(stall_s=0.0, clock=lambda: now[0]).check()[0]  # 0: off


def test_a_taken_port_is_a_config_error_naming_the_setting_and_port() -> None:
    from grpo_core.config import ConfigError

    first = MetricsServer(CollectorRegistry(), MetricsConfig(port=0)).start()
    try:
        taken = MetricsConfig(host="127.0.0.1", port=first.port)
        with pytest.raises(ConfigError) as err:
            MetricsServer(CollectorRegistry(), taken).start()
        assert str(err.value) == (f"metrics.port {first.port} on 127.0.0.1: address already in use (another "
                                  "process? set metrics.port to a free port, or 0 for any)")
        with pytest.raises(ConfigError, match=f"^metrics_port {first.port} on 127.0.0.1: address already in use"):
            MetricsServer(CollectorRegistry(), taken, setting="metrics_port").start()
        with pytest.raises(ConfigError, match="^metrics.port 9 on 203.0.113.9: cannot listen: "):
            MetricsServer(CollectorRegistry(), MetricsConfig(host="203.0.113.9", port=9)).start()
    finally:
        first.stop()


def test_a_client_hanging_up_mid_reply_leaves_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """A scraper that gives up (or a peer that stops) while the reply is being written is not an error: no
    BrokenPipeError/ConnectionResetError traceback on stderr, and the server keeps serving."""
    import socket
    import struct
    import time

    big = b"x" * (32 << 20)  # far more than the socket buffers take: the write is under way when the reset comes
    server = MetricsServer(CollectorRegistry(), MetricsConfig(port=0), routes={"/big": lambda: ("text/plain", big)})
    server.start()
    try:
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", server.port))
            client.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(64).startswith(b"HTTP/1.0 200")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            client.close()
        time.sleep(1.0)
        assert _get(f"http://127.0.0.1:{server.port}/health")[0] == 200
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err


@pytest.mark.parametrize("role", ["learner", "producer", "feeder", "verifier"])
def test_every_role_exports_process_metrics(role: str) -> None:
    """Each role's own registry carries process_* (CPU, memory, fds, start time): a restart shows."""
    from prometheus_client import generate_latest

    from grpo_learner.metrics import LearnerMetrics
    from grpo_producers.feeder_metrics import FeederMetrics
    from grpo_producers.metrics import ProducerMetrics
    from grpo_verifiers.metrics import VerifierMetrics

    cls = {"learner": LearnerMetrics, "producer": ProducerMetrics, "feeder": FeederMetrics,
           "verifier": VerifierMetrics}[role]
    text = generate_latest(cls().registry).decode()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
                 "process_open_fds", "python_info"):
        assert f"\n{name}" in text, (role, name)
