"""The learner's metrics: declared here once, fed from one place per step (the math never touches them)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from grpo_core.metrics import DECODE, dead_letter_counter, init_series, role_registry
from grpo_core.trackers import Trackers

# Gauges that mirror a StepStats metric of the same name (loss, kl, clip fractions, ratios, rewards, ...).
STEP_GAUGES = ("loss", "kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "entropy",
               "reward_mean", "reward_std", "zero_variance_fraction", "grad_norm", "lr", "cpu_share", "sys_share")
PHASES = ("wait", "collate", "forward_old", "forward", "backward", "optimizer", "publish", "checkpoint")
# The reason classes (text before the first ':') the learner's source gives a group it cannot train
# (grpo_learner.source: _invalid sends these to the dlq, _drop_reason adds the rest); each labelled series exists
# from the start. tests/test_monitoring.py fails when the code gives a reason that is not listed here.
DEAD_LETTER_REASONS = (DECODE, "future_version", "wrong_group_size", "partial_group", "too_long")
DROP_REASONS = (*DEAD_LETTER_REASONS, "duplicate", "stale", "reward_failed", "zero_variance")


class LearnerMetrics:
    def __init__(self, jsonl_path: Path | None = None, trackers: Trackers | None = None) -> None:
        r = self.registry = role_registry()
        p = "grpo_stream_learner_"
        self.steps = Counter(p + "steps_total", "Learner steps completed", registry=r)
        self.version = Gauge(p + "policy_version", "Latest published policy version", registry=r)
        self.step = Gauge(p + "step", "Current learner step", registry=r)
        self.gauges = {k: Gauge(p + k, f"Last step's {k}", registry=r) for k in STEP_GAUGES}
        self.staleness = Histogram(p + "staleness_steps", "Staleness of trained groups (learner steps)",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.span = Histogram(p + "version_span_steps", "Newest minus oldest version behind a trained group's "
                              "tokens (> 0 after an in-flight weight swap)", buckets=(0, 1, 2, 4, 8, 16),
                              registry=r)
        self.trained = Counter(p + "groups_trained_total", "Groups trained", registry=r)
        self.dropped = init_series(Counter(p + "groups_dropped_total", "Groups not trained, by reason", ["reason"],
                                           registry=r), DROP_REASONS)
        self.tokens = Counter(p + "tokens_total", "Completion tokens trained", registry=r)
        self.tokens_per_s = Gauge(p + "tokens_per_second", "Completion tokens per second of step time", registry=r)
        self.phase = init_series(Histogram(p + "step_phase_seconds", "Step time by phase", ["phase"], registry=r,
                                           buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)),
                                 PHASES)
        self.skipped = Counter(p + "skipped_updates_total", "Updates skipped: non-finite loss/grad", registry=r)
        self.checkpoints_rejected = Counter(p + "checkpoints_rejected_total", "Checkpoints found damaged or "
                                            "incomplete at start-up and skipped for an older one", registry=r)
        self.lag = Gauge(p + "consumer_lag_groups", "Groups in the topic not yet consumed", registry=r)
        self.published = Counter(p + "weights_published_total", "Weight versions published", registry=r)
        self.published_bytes = Counter(p + "weights_published_bytes_total", "Bytes of weights published",
                                       registry=r)
        self.publish_seconds = Histogram(p + "publish_seconds", "Write + announce of a version, in the background "
                                         "unless publish_async is off", registry=r,
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.save_wait = init_series(Counter(p + "save_wait_seconds_total", "Seconds the step loop waited for the "
                                             "previous publish or checkpoint to finish writing", ["kind"],
                                             registry=r), ("publish", "checkpoint"))
        self.publishes_skipped = Counter(p + "publishes_skipped_total", "Publish steps passed over because the "
                                         "previous version was still being written (publish_overlap: skip)",
                                         registry=r)
        self.dead = dead_letter_counter(r, "learner", DEAD_LETTER_REASONS)
        self._jsonl = jsonl_path.open("a", encoding="utf-8") if jsonl_path else None
        self.trackers = trackers

    def observe_step(self, step: int, metrics: dict[str, float], timings: dict[str, float],
                     staleness: list[int], dropped: list[str], tokens: int, skipped: int, lag: int,
                     spans: list[int] | None = None) -> None:
        self.steps.inc()
        self.step.set(step)
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        for s in staleness:
            self.staleness.observe(s)
        for s in spans or ():
            self.span.observe(s)
        self.trained.inc(len(staleness))
        self.observe_drops(dropped)
        self.tokens.inc(tokens)
        total = sum(timings.values())
        if total > 0:
            self.tokens_per_s.set(tokens / total)
        for phase, seconds in timings.items():
            self.phase.labels(phase=phase).observe(seconds)
        self.skipped.inc(skipped)
        self.lag.set(lag)
        self._write_jsonl({"step": step, "time": time.time(), **metrics, "timings": timings, "staleness": staleness,
                           "version_span": spans or [], "dropped": dropped, "tokens": tokens,
                           "skipped_updates": skipped, "lag": lag})

    def observe_drops(self, dropped: list[str]) -> None:
        """Groups dropped, by reason (at a step, or on a ``no_update`` line: nothing trainable was left)."""
        for reason in dropped:
            self.dropped.labels(reason=reason.split(":", 1)[0]).inc()

    def observe_publish(self, version: int, size_bytes: int, seconds: float) -> None:
        self.version.set(version)
        self.published.inc()
        self.published_bytes.inc(size_bytes)
        self.publish_seconds.observe(seconds)

    def observe_wait(self, kind: str, seconds: float) -> None:
        self.save_wait.labels(kind=kind).inc(seconds)

    def _write_jsonl(self, line: dict[str, Any]) -> None:
        """The one place a step's metrics go out: metrics.jsonl (the source of truth), then the trackers."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(line, default=float) + "\n")
            self._jsonl.flush()
        if self.trackers is not None:
            self.trackers.log(line, int(line["step"]))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self.trackers is not None:
            self.trackers.close()
