"""The feeder's metrics, declared once (``grpo_producers.feeder`` feeds them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from grpo_core.metrics import init_series, role_registry

# The reasons a dataset item is skipped (``on_bad(reason, where)`` in grpo_producers.datasets,
# .reasoning_gym_source and .feeder); each labelled series exists from the start. tests/test_monitoring.py fails
# when the code gives a reason not listed here.
BAD_ITEM_REASONS = (
    "missing_prompt", "missing_answer", "missing_id", "bad_metadata", "invalid_utf8", "invalid_json",
    "not_an_object", "too_long", "duplicate_id", "unencodable", "unencodable_entry", "generation_error",
    "no_source_dataset", "in_train",
)


class FeederMetrics:
    def __init__(self) -> None:
        r = self.registry = role_registry()
        p = "grpo_stream_feeder_"
        self.published = Counter(p + "prompts_published_total", "PromptTasks acknowledged by the broker",
                                 registry=r)
        self.bad = init_series(Counter(p + "bad_items_total", "Dataset items skipped, by reason", ["reason"],
                                       registry=r), BAD_ITEM_REASONS)
        self.epoch = Gauge(p + "epoch", "Epoch being published", registry=r)
        self.position = Gauge(p + "position", "Next position in the epoch's schedule", registry=r)
        self.items = Gauge(p + "dataset_items", "Valid items in the dataset", registry=r)
        self.ahead = Gauge(p + "prompts_ahead", "Unconsumed prompts of the producers' group (max_ahead)", registry=r)
