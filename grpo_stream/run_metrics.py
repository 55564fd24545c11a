"""The run supervisor's own ``/metrics`` (``grpo-stream run``, port ``metrics_port``): its children's health.

* ``grpo_stream_run_restarts_total{role}``: children of the role that exited with an error (the supervisor
  restarts each with backoff, up to ``max_restarts``);
* ``grpo_stream_run_child_up{role,index}``: 1 while the child's process runs, 0 once it exited;
* ``grpo_stream_run_last_restart_reason{role,index,reason}``: 1 for the reason of the child's last error exit
  (``exit 1``, ``SIGKILL``, ...), ``none`` before its first one -- the run's counterpart of kube-state-metrics'
  ``kube_pod_container_status_last_terminated_reason``;
* ``process_*`` of the supervisor itself.

``/targets`` lists the children's own metrics endpoints as Prometheus HTTP service discovery
(``http_sd_configs``; ``ops/prometheus/prometheus-run.yml``): each child logs the address it bound (a port 0
becomes a free one), and the supervisor sees every line of its output.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from grpo_core.config import MetricsConfig
from grpo_core.metrics import MetricsServer, init_series, role_registry

if TYPE_CHECKING:
    from grpo_stream.run import Child, Supervisor

NO_RESTART = "none"
CHILD_UP, LAST_RESTART_REASON = "grpo_stream_run_child_up", "grpo_stream_run_last_restart_reason"
# What grpo_core.metrics.MetricsServer logs once it listens.
_LISTENING = re.compile(r"metrics on http://(\S+):(\d+)/metrics")


def role_index(child: str) -> tuple[str, str]:
    """``producer-1`` -> (``producer``, ``1``); ``learner`` -> (``learner``, ``0``)."""
    role, _, index = child.partition("-")
    return role, index or "0"


def exit_reason(rc: int) -> str:
    """A child's exit status in words: ``exit 1``, or the signal that ended it (``SIGKILL``)."""
    if rc >= 0:
        return f"exit {rc}"
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class RunMetrics:
    """The supervisor's registry and endpoint; :meth:`watch` ties it to a :class:`Supervisor`."""

    def __init__(self, host: str, port: int) -> None:
        r = self.registry = role_registry()
        self.restarts = Counter("grpo_stream_run_restarts_total", "Children of the role that exited with an "
                                "error (each restarted with backoff until max_restarts)", ["role"], registry=r)
        self.children: list[Child] = []
        self.reasons: dict[str, str] = {}  # child -> reason of its last error exit
        self.targets: dict[str, str] = {}  # child -> host:port of its /metrics, from its log
        r.register(self)
        self.server = MetricsServer(r, MetricsConfig(host=host, port=port), setting="metrics_port",
                                    routes={"/targets": self._targets})

    def start(self) -> RunMetrics:
        """Listen (before anything else starts: a taken port is a one-line ConfigError naming metrics_port)."""
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def watch(self, sup: Supervisor) -> None:
        """Count ``sup``'s error exits, read its children's state at each scrape and their metrics addresses
        from their output (the sink every child is given is wrapped here, before any child starts)."""
        cfg = sup.cfg
        init_series(self.restarts, ["learner", *(["feeder"] if cfg.feeder else []),
                                    *(["producer"] if cfg.producers.count else []),
                                    *(["verifier"] if cfg.verifiers.count else [])])
        self.children = sup.children
        sup.on_crash = self.crashed
        inner = sup.sink

        def sink(name: str, line: str) -> None:
            self.observe_line(name, line)
            inner(name, line)

        sup.sink = sink

    def crashed(self, child: Child, rc: int) -> None:
        self.restarts.labels(role_index(child.name)[0]).inc()
        self.reasons[child.name] = exit_reason(rc)  # its target stays listed (down) until its next process logs

    def observe_line(self, child: str, line: str) -> None:
        if (m := _LISTENING.search(line)) is None:
            return
        host = "127.0.0.1" if m[1] in ("0.0.0.0", "::", "[::]") else m[1]
        self.targets[child] = f"[{host}]:{m[2]}" if ":" in host and not host.startswith("[") else f"{host}:{m[2]}"

    def _targets(self) -> tuple[str, bytes]:
        """The children's endpoints, but not those of children that finished (exit 0: nothing to scrape, and
        not down either); a crashed one stays listed, so its target reads as down until its restart."""
        finished = {c.name for c in list(self.children) if c.proc is not None and c.proc.returncode == 0}
        groups = [{"targets": [address], "labels": {"role": role_index(child)[0], "child": child}}
                  for child, address in sorted(dict(self.targets).items()) if child not in finished]
        return "application/json", json.dumps(groups).encode()

    def collect(self) -> Iterator[Any]:
        """The per-child series, from the supervisor's children as they are at the scrape."""
        up = GaugeMetricFamily(CHILD_UP, "1 while the child's process runs, 0 once it exited "
                               "(crashed and waiting for its restart, given up, or done)", labels=["role", "index"])
        reason = GaugeMetricFamily(LAST_RESTART_REASON, "1 for the reason of the child's last "
                                   "error exit (exit code or signal); 'none' before its first",
                                   labels=["role", "index", "reason"])
        for c in list(self.children):
            labels = list(role_index(c.name))
            up.add_metric(labels, float(c.proc is not None and c.proc.returncode is None))
            reason.add_metric([*labels, self.reasons.get(c.name, NO_RESTART)], 1.0)
        yield up
        yield reason
