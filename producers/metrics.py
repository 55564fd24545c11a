"""The producer's metrics, declared once; the loops feed them after each batch or group."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from grpo_core.metrics import DECODE, dead_letter_counter, init_series, role_registry

# The reason classes the producer gives (text before the first ':'): a prompt it sends to the dlq
# (grpo_producers.service, .continuous), and a pause (grpo_producers.backpressure.pause_reason). Each labelled
# series exists from the start; tests/test_monitoring.py fails when the code gives a reason not listed here.
DEAD_LETTER_REASONS = (DECODE, "empty_prompt", "prompt_too_long", "generation_error")
PAUSE_REASONS = ("backlog", "version_lag")


class ProducerMetrics:
    def __init__(self) -> None:
        r = self.registry = role_registry()
        p = "grpo_stream_producer_"
        self.tokens = Counter(p + "tokens_total", "Completion tokens generated", registry=r)
        self.completions = Counter(p + "completions_total", "Completions published", registry=r)
        self.groups = Counter(p + "groups_total", "Groups (prompts x G) published", registry=r)
        self.tokens_per_s = Gauge(p + "tokens_per_second", "Generation throughput of the last batch", registry=r)
        self.completions_per_s = Gauge(p + "completions_per_second", "Completions/s of the last batch", registry=r)
        self.version = Gauge(p + "policy_version", "Policy version of the weights in use", registry=r)
        self.newest_version = Gauge(p + "announced_version", "Newest version the learner announced", registry=r)
        self.swap_latency = Histogram(p + "weight_swap_latency_seconds",
                                      "Announcement -> first completion generated with the new version",
                                      buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300), registry=r)
        self.swap_load = Histogram(p + "weight_load_seconds", "Fetch + verify + load of new weights",
                                   buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.paused = init_series(Counter(p + "paused_seconds_total", "Seconds paused by backpressure", ["reason"],
                                          registry=r), PAUSE_REASONS)
        self.backlog = Gauge(p + "backlog_groups", "Backlog seen at the last check (groups)", registry=r)
        self.generation_errors = Counter(p + "generation_errors_total", "Failed generation batches", registry=r)
        self.weight_errors = Counter(p + "weight_fetch_errors_total", "Failed weight fetches", registry=r)
        self.versions_skipped = Counter(p + "weight_versions_skipped_total", "Announced weight versions passed over "
                                        "for a newer one after their fetch failed", registry=r)
        self.batch_seconds = Histogram(p + "batch_seconds", "Generation time per batch", registry=r,
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.inflight = Gauge(p + "inflight_groups", "Groups in the engine (weights.swap=inflight)", registry=r)
        self.engine_busy = Counter(p + "engine_busy_seconds_total", "Seconds with at least one group in the "
                                   "engine (weights.swap=inflight); its rate is the engine's busy fraction",
                                   registry=r)
        self.starved = Counter(p + "starved_seconds_total", "Seconds with room in the engine, not held back, and no "
                               "prompt to take (weights.swap=inflight): the feeder is not keeping ahead", registry=r)
        self.aborted_stale = Counter(p + "aborted_stale_total", "Groups aborted in the engine and generated again "
                                     "because their oldest version fell more than pipeline.max_staleness behind "
                                     "the newest announced one (the learner would drop them)", registry=r)
        self.dead = dead_letter_counter(r, "producer", DEAD_LETTER_REASONS)
