"""The Grafana dashboards (``ops/grafana/dashboards/*.json``), generated with Grafana's own SDK
(``grafana-foundation-sdk``) from the roles' metrics modules.

Every metric name in a query comes from the metrics object that exports it (``LearnerMetrics().tokens`` ->
``grpo_stream_learner_tokens_total``), so a metric renamed or removed in a role changes or breaks the generation
instead of leaving a dead panel; ``grpo-stream dashboards --check`` (and ``tests/test_ops.py``) fails when the
committed JSON differs from what this code generates. ``grpo-stream dashboards`` rewrites the files.

The panels are data (:class:`Panel`: a title, a unit, PromQL queries with legends); the SDK's builders turn them
into dashboards (layout: two panels a row, 8 units high).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DASHBOARDS_DIR = Path("ops/grafana/dashboards")
RATE = "5m"  # the rate window of throughput panels
# Every grpo-stream scrape job (ops/prometheus/*.yml: grpo-stream-<role>, grpo-stream-run for the supervisor).
JOBS = 'job=~"grpo-stream-.+"'
K8S = 'namespace="grpo-stream"'  # kube-state-metrics' series of the deployment (ops/k8s)


class Names:
    """The exported sample names of one role's metrics object, by attribute (``names.tokens``); a learner gauge
    of the per-step set by its key (``names.gauge("loss")``). A missing attribute raises: a dead panel cannot be
    generated."""

    def __init__(self, metrics: object) -> None:
        self._metrics = metrics

    @staticmethod
    def _sample(metric: Any) -> str:
        return metric._name + ("_total" if metric._type == "counter" else "")

    def __getattr__(self, attr: str) -> str:
        return self._sample(getattr(self._metrics, attr))

    def gauge(self, key: str) -> str:
        return self._sample(self._metrics.gauges[key])  # type: ignore[attr-defined]


@dataclass
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: Literal["timeseries", "heatmap"] = "timeseries"


@dataclass
class Dashboard:
    uid: str
    title: str
    tags: list[str]
    panels: list[Panel] = field(default_factory=list)


def _rate(name: str, window: str = RATE) -> str:
    return f"rate({name}[{window}])"


def _quantile(q: float, histogram: str, window: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket[{window}])))"


def _mean(histogram: str, window: str, by: str = "") -> str:
    group = f"sum by ({by}) " if by else "sum"
    return f"{group}(rate({histogram}_sum[{window}])) / {group}(rate({histogram}_count[{window}]))"


def training(L: Names) -> Dashboard:
    g = L.gauge
    return Dashboard("grpo-training", "grpo-stream / training", ["grpo-stream", "training"], [
        Panel("Reward (mean ± std of trained groups)", [(g("reward_mean"), "mean"), (g("reward_std"), "std")]),
        Panel("Loss", [(g("loss"), "loss")]),
        Panel("KL to reference (k3)", [(g("kl"), "kl")]),
        Panel("Clip fractions", [(g("clip_frac_low"), "low"), (g("clip_frac_high"), "high")], "percentunit"),
        Panel("Entropy", [(g("entropy"), "entropy")]),
        Panel("Groups without signal (all G rewards equal)", [(g("zero_variance_fraction"), "share of groups")],
              "percentunit"),
        Panel("Importance ratio", [(g("ratio_mean"), "mean"), (g("ratio_max"), "max")]),
        Panel("Gradient norm", [(g("grad_norm"), "grad norm")]),
        Panel("Learning rate", [(g("lr"), "lr")]),
        Panel("Learner step / published policy version", [(L.step, "step"), (L.version, "published version")]),
        Panel("Steps per minute", [(f"{_rate(L.steps)} * 60", "steps/min")]),
        Panel("Learner CPU during a step (CPU learners: near 1 unless its CPUs went elsewhere)",
              [(g("cpu_share"), "CPU share"), (g("sys_share"), "kernel's part")], "percentunit"),
        Panel("Groups trained / dropped per second", [
            (_rate(L.trained), "trained"), (f"sum by (reason) ({_rate(L.dropped)})", "dropped: {{reason}}")]),
        Panel("Skipped updates (non-finite loss/grad)", [(f"increase({L.skipped}[15m])", "skipped (15m)")]),
        Panel("Saving off the step loop: the loop's wait for the previous write, per second (0: fully hidden)", [
            (f"sum by (kind) ({_rate(L.save_wait)})", "waited for {{kind}}"),
            (_mean(L.publish_seconds, "5m"), "background publish, mean s"),
            (_rate(L.publishes_skipped), "publishes skipped /s")]),
    ])


def pipeline(L: Names, P: Names, F: Names, V: Names) -> Dashboard:
    return Dashboard("grpo-pipeline", "grpo-stream / pipeline", ["grpo-stream", "pipeline"], [
        Panel("Prompts published/s (feeder)", [(f"sum({_rate(F.published)})", "prompts/s"),
                                                (F.ahead, "unconsumed prompts (max_ahead)")]),
        Panel("Completions/s per producer", [(_rate(P.completions), "{{instance}}")]),
        Panel("Tokens/s: producers vs learner", [(f"sum({_rate(P.tokens)})", "generated"),
                                                  (f"sum({_rate(L.tokens)})", "trained")]),
        Panel("Verifier throughput", [(f"sum({_rate(V.completions)})", "completions scored/s"),
                                      (f"sum({_rate(V.groups)})", "groups published/s")]),
        Panel("Staleness of trained groups (learner steps)", [
            (f"sum by (le) (increase({L.staleness}_bucket[$__rate_interval]))", "{{le}}")], kind="heatmap"),
        Panel("Staleness p50 / p95", [(_quantile(0.5, L.staleness, "10m"), "p50"),
                                      (_quantile(0.95, L.staleness, "10m"), "p95")]),
        Panel("Policy version per producer (vs learner)", [
            (P.version, "{{instance}}"), (f"max({L.version})", "learner published"),
            (f"max({P.newest_version})", "announced")]),
        Panel("Weight swap latency (announcement → first completion)", [
            (_quantile(0.5, P.swap_latency, "30m"), "p50"), (_quantile(0.95, P.swap_latency, "30m"), "p95"),
            (_mean(P.swap_load, "30m"), "mean load time")], "s"),
        Panel("Backpressure: fraction of time paused, by reason (and starved of prompts)", [
            (f"sum by (reason) ({_rate(P.paused)})", "{{reason}}"),
            (f"sum({_rate(P.starved)})", "no prompt to take (feeder behind)")], "percentunit"),
        Panel("Backlog seen by producers (groups)", [(P.backlog, "{{instance}}")]),
        Panel("Learner step time by phase (mean)", [(_mean(L.phase, RATE, by="phase"), "{{phase}}")], "s"),
        Panel("Generation batch time p95 / errors", [
            (_quantile(0.95, P.batch_seconds, "10m"), "batch p95 (s)"),
            (f"sum(increase({P.generation_errors}[10m]))", "generation errors (10m)"),
            (f"sum(increase({P.weight_errors}[10m]))", "weight fetch errors (10m)")]),
        Panel("Rewards without a verdict: failed (errors) / 0 by rule, per second by kind", [
            (f"sum by (reason) ({_rate(V.reward_errors)})", "failed: {{reason}}"),
            (f"sum by (reason) ({_rate(V.reward_zero)})", "0 by rule: {{reason}}")]),
    ])


def kafka(L: Names, P: Names, F: Names, V: Names) -> Dashboard:
    roles = (("producer", P), ("verifier", V), ("learner", L))
    return Dashboard("grpo-kafka", "grpo-stream / kafka", ["grpo-stream", "kafka"], [
        Panel("Learner lag on groups (consumer group learner)", [(L.lag, "groups not consumed")]),
        Panel("Verifier lag on completions (consumer group verifiers)", [(f"sum({V.lag})", "total"),
                                                                          (V.lag, "{{instance}}")]),
        Panel("Producers' backlog (groups + unscored completions / G)", [(P.backlog, "{{instance}}")]),
        Panel("Unconsumed prompts (consumer group producers)", [(F.ahead, "prompts")]),
        Panel("DLQ records/s by role", [(f"sum({_rate(n.dead)})", role) for role, n in roles]),
        Panel("DLQ records/s by reason", [(f"sum by (reason) ({_rate(n.dead)})", f"{role}: {{{{reason}}}}")
                                          for role, n in roles]),
        Panel("Weights published (bytes/s to the store)", [(_rate(L.published_bytes, "30m"), "bytes/s")], "Bps"),
        Panel("Feeder: epoch / position", [(F.epoch, "epoch"), (F.position, "position"),
                                           (F.items, "dataset items")]),
    ])


def health(R: Names, L: Names, P: Names) -> Dashboard:
    """Is every process there, and did any restart: ``up``, ``process_*`` (every role's registry carries them),
    the run supervisor's children (grpo_stream.run_metrics) and, on Kubernetes, kube-state-metrics."""
    from grpo_stream.run_metrics import CHILD_UP, LAST_RESTART_REASON

    return Dashboard("grpo-health", "grpo-stream / health", ["grpo-stream", "health"], [
        Panel("Targets up (1) or unreachable (0)", [(f"up{{{JOBS}}}", "{{role}} {{instance}}")]),
        Panel("Process restarts in the last hour (its start time changed)", [
            (f"changes(process_start_time_seconds{{{JOBS}}}[1h])", "{{role}} {{instance}}")]),
        Panel("Error exits in the last hour: grpo-stream run / Kubernetes", [
            (f"sum by (role) (increase({R.restarts}[1h]))", "run: {{role}}"),
            (f"sum by (container) (increase(kube_pod_container_status_restarts_total{{{K8S}}}[1h]))",
             "k8s: {{container}}")]),
        Panel("Children running (grpo-stream run)", [(CHILD_UP, "{{role}}-{{index}}")]),
        Panel("Last restart reason (1 = the reason of the last error exit)", [
            (LAST_RESTART_REASON, "{{role}}-{{index}}: {{reason}}"),
            (f"kube_pod_container_status_last_terminated_reason{{{K8S}}}", "{{pod}}: {{reason}}")]),
        Panel("CPU per process (cores)", [(f"rate(process_cpu_seconds_total{{{JOBS}}}[{RATE}])",
                                           "{{role}} {{instance}}")]),
        Panel("Resident memory per process", [(f"process_resident_memory_bytes{{{JOBS}}}", "{{role}} {{instance}}")],
              "bytes"),
        Panel("Open file descriptors (share of the limit)", [
            (f"process_open_fds{{{JOBS}}} / process_max_fds{{{JOBS}}}", "{{role}} {{instance}}")], "percentunit"),
        Panel("Damaged state passed over (1h): learner checkpoints, producer weight versions", [
            (f"sum(increase({L.checkpoints_rejected}[1h]))", "checkpoints rejected at start-up"),
            (f"sum by (instance) (increase({P.versions_skipped}[1h]))", "versions skipped: {{instance}}")]),
    ])


def dashboards() -> dict[str, Dashboard]:
    """file stem -> dashboard, with every name from a fresh metrics object of each role."""
    from grpo_learner.metrics import LearnerMetrics
    from grpo_producers.feeder_metrics import FeederMetrics
    from grpo_producers.metrics import ProducerMetrics
    from grpo_stream.run_metrics import RunMetrics
    from grpo_verifiers.metrics import VerifierMetrics

    L, P, F, V = (Names(m()) for m in (LearnerMetrics, ProducerMetrics, FeederMetrics, VerifierMetrics))
    R = Names(RunMetrics("127.0.0.1", -1))
    return {"training": training(L), "pipeline": pipeline(L, P, F, V), "kafka": kafka(L, P, F, V),
            "health": health(R, L, P)}


def render(d: Dashboard) -> str:
    """The dashboard as Grafana JSON, built with the SDK's builders."""
    from grafana_foundation_sdk.builders import common, heatmap, prometheus, timeseries
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    ds = DataSourceRef(type_val="prometheus", uid="prometheus")
    board = (dash.Dashboard(d.title).uid(d.uid).tags(d.tags).refresh("30s").time("now-6h", "now")
             .timezone("browser").editable())
    for i, p in enumerate(d.panels, start=1):
        builder: Any = heatmap.Panel() if p.kind == "heatmap" else timeseries.Panel()
        builder.id(i).title(p.title).datasource(ds).unit(p.unit).height(8).span(12)
        if p.kind == "heatmap":
            builder.calculate(False).cell_gap(1).y_axis(heatmap.YAxisConfig().unit(p.unit))
        else:
            builder.legend(common.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                           .placement(LegendPlacement.BOTTOM).show_legend(True).calcs([]))
            builder.tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.NONE))
        for k, (expr, legend) in enumerate(p.queries):
            query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + k)).datasource(ds)
            if p.kind == "heatmap":
                query.format(PromQueryFormat.HEATMAP)
            builder.with_target(query)
        board.with_panel(builder)
    return JSONEncoder(sort_keys=True, indent=2).encode(board.build()) + "\n"


def main(check: bool, root: str = ".", emit: Callable[[str], None] = print) -> int:
    """Write (or with ``check``, compare) every dashboard under ``root``; 1 when a committed file differs."""
    out = Path(root) / DASHBOARDS_DIR
    stale = []
    for stem, d in dashboards().items():
        path, text = out / f"{stem}.json", render(d)
        old = path.read_text() if path.exists() else ""
        if old == text:
            continue
        if check:
            stale.append(path)
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=1)
            emit("\n".join(list(diff)[:40]))
        else:
            path.write_text(text)
            emit(f"wrote {path}")
    if stale:
        emit(f"{len(stale)} dashboard(s) differ from what grpo_stream/dashboards.py generates: run "
             "`grpo-stream dashboards` and commit the result")
    return 1 if stale else 0
