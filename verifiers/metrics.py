"""The verifier's metrics, declared once; the service feeds them per scored batch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grpo_core.metrics import dead_letter_counter


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "grpo_stream_verifier_"
        self.groups = Counter(p + "groups_published_total", "ScoredGroups published", ["task"], registry=r)
        self.completions = Counter(p + "completions_total", "Completions consumed (decodable)", registry=r)
        self.groups_per_s = Gauge(p + "groups_per_second", "Groups published per second (last batch)", registry=r)
        self.reward_mean = Gauge(p + "reward_mean", "Mean reward of the last scored batch", ["task"], registry=r)
        self.pass_rate = Gauge(p + "pass_rate", "Share of completions with reward 1 (last batch)", ["task"],
                               registry=r)
        self.reward_seconds = Histogram(p + "reward_seconds", "Reward call latency", registry=r,
                                        buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.reward_errors = Counter(p + "reward_errors_total", "Scored members whose reward gave no value, by "
                                     "reason kind (a real 0 or failed: grpo_verifiers.rewards.failures)", ["reason"],
                                     registry=r)
        self.reward_failed = Counter(p + "reward_failed_total", "Members published as failed (no score after "
                                     "retries; the learner never trains on them)", registry=r)
        self.worker_restarts = Counter(p + "reward_worker_restarts_total", "Reward workers replaced", registry=r)
        self.partial = Counter(p + "partial_groups_total", "Groups published with fewer than G members", registry=r)
        self.dropped = Counter(p + "dropped_groups_total", "Incomplete groups sent to the dlq", registry=r)
        self.dedup = Counter(p + "dedup_hits_total", "Duplicate completions ignored", registry=r)
        self.lag = Gauge(p + "consumer_lag_completions", "Completions not yet consumed (assigned partitions)",
                         registry=r)
        self.pending = Gauge(p + "pending_groups", "Groups being assembled", registry=r)
        self.dead = dead_letter_counter(r, "verifier")
