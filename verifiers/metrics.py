"""The verifier's metrics, declared once; the service feeds them per scored batch."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from grpo_core.metrics import DECODE, dead_letter_counter, init_series, role_registry
from grpo_verifiers.rewards import failures

# The reason classes (text before the first ':') grpo_verifiers.service gives a record it sends to the dlq; each
# labelled series exists from the start. tests/test_monitoring.py fails when the code gives one not listed here.
DEAD_LETTER_REASONS = (DECODE, "group_size_mismatch", "incomplete_group", "group_too_large", "invalid_group")
# Reward outcome kinds (rewards.failures.POLICY, the one declared list): a failure is an error, a 0 by rule
# (the completion's own fault, e.g. empty) is not; the kinds a term's zero_on may move are in both.
ERROR_KINDS = sorted(k for k, p in failures.POLICY.items() if p == "fail")
ZERO_KINDS = sorted({k for k, p in failures.POLICY.items() if p == "zero"} | failures.ZEROABLE)


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = role_registry()
        p = "grpo_stream_verifier_"
        self.groups = Counter(p + "groups_published_total", "ScoredGroups published", ["task"], registry=r)
        self.completions = Counter(p + "completions_total", "Completions consumed (decodable)", registry=r)
        self.groups_per_s = Gauge(p + "groups_per_second", "Groups published per second (last batch)", registry=r)
        self.reward_mean = Gauge(p + "reward_mean", "Mean reward of the last scored batch", ["task"], registry=r)
        self.pass_rate = Gauge(p + "pass_rate", "Share of completions with reward 1 (last batch)", ["task"],
                               registry=r)
        self.reward_seconds = Histogram(p + "reward_seconds", "Reward call latency", registry=r,
                                        buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.reward_errors = init_series(Counter(
            p + "reward_errors_total", "Scored members whose reward failed (no score after retries, published as "
            "failed), by reason kind (grpo_verifiers.rewards.failures); a 0 by rule is not an error: "
            "reward_zero_total", ["reason"], registry=r), ERROR_KINDS)
        self.reward_zero = init_series(Counter(
            p + "reward_zero_total", "Scored members given 0 by rule instead of a reward's verdict: the completion's "
            "own fault (empty, oversized, invalid_utf8, or a kind a term's zero_on names), by reason kind",
            ["reason"], registry=r), ZERO_KINDS)
        self.reward_failed = Counter(p + "reward_failed_total", "Members published as failed (no score after "
                                     "retries; the learner never trains on them)", registry=r)
        self.worker_restarts = Counter(p + "reward_worker_restarts_total", "Reward workers replaced", registry=r)
        self.partial = Counter(p + "partial_groups_total", "Groups published with fewer than G members", registry=r)
        self.dropped = Counter(p + "dropped_groups_total", "Incomplete groups sent to the dlq", registry=r)
        self.dedup = Counter(p + "dedup_hits_total", "Duplicate completions ignored", registry=r)
        self.lag = Gauge(p + "consumer_lag_completions", "Completions not yet consumed (assigned partitions)",
                         registry=r)
        self.pending = Gauge(p + "pending_groups", "Groups being assembled", registry=r)
        self.dead = dead_letter_counter(r, "verifier", DEAD_LETTER_REASONS)

    def observe_reward(self, error: str | None, failed: bool) -> None:
        """One scored member: a failed reward is an error, by its kind; a reason with a score is a 0 by rule."""
        if failed:
            self.reward_failed.inc()
        if error:
            (self.reward_errors if failed else self.reward_zero).labels(reason=failures.kind(error)).inc()
