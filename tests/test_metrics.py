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
    dead = dead_letter_counter(registry, "test")
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
