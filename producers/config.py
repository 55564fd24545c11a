"""The producer's typed config (``grpo-stream producer --config FILE [key=value ...]``)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_stream.config import KafkaConfig, MetricsConfig, TopicsConfig, opt, require
from grpo_stream.weight_store import WeightStoreConfig
from producers.backends.base import BackendConfig, SamplingConfig


@dataclass
class ProducerConfig:
    """One generation worker: prompts in, G completions per prompt out, weights hot-swapped."""

    producer_id: str = opt("", "Stamped on every completion. Empty: <hostname>-<pid>.")
    run: str = opt("grpo", "Whose weight announcements to follow (the learner's run name).")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    topics: TopicsConfig = opt(factory=TopicsConfig, help="Topic names (the plan).")
    metrics: MetricsConfig = opt(factory=MetricsConfig, help="/metrics and /health endpoint.")
    backend: BackendConfig = opt(factory=lambda: BackendConfig(model=""), help="Generation engine (hf|vllm).")
    sampling: SamplingConfig = opt(factory=SamplingConfig, help="Sampling parameters.")
    weights: WeightStoreConfig = opt(factory=WeightStoreConfig, help="Where announced weights are fetched from.")
    group_size: int = opt(16, "G: completions generated per prompt (one group).")
    prompts_per_batch: int = opt(8, "Prompts taken per generation batch (batch = prompts x G sequences).")
    consumer_group: str = opt("producers", "Consumer group on the prompts topic: N producers share the work.")
    learner_group: str = opt("learner", "The learner's consumer group on groups (its lag is the backlog).")
    verifier_group: str = opt("verifiers", "The verifiers' group on completions (unscored work in flight).")
    max_backlog_groups: int = opt(
        0, "Pause while groups not yet consumed by the learner (+ unscored ones) reach this. 0: no limit. Live. "
        "Keep it >= the learner's groups_per_batch, or the learner never gets a full batch.")
    max_version_lag: int = opt(
        -1, "Block while the newest announced version is ahead of ours by more than this. -1: off. Live.")
    control_file: str = opt(
        "", "Optional YAML with max_backlog_groups / max_version_lag, re-read when it changes (a mounted "
        "ConfigMap in k8s): the live knobs.")
    backpressure_poll_s: float = opt(1.0, "How often a paused producer re-checks offsets and weights.")
    initial_version: int = opt(0, "Policy version of the weights the backend starts with (the learner's v0).")
    follow_weights: bool = opt(True, "Hot-swap to newer announced weights between batches.")
    apply_chat_template: bool = opt(False, "Wrap prompt text with the tokenizer's chat template when it has one.")
    max_poll_interval_ms: int = opt(600_000, "Consumer max.poll.interval: longer than one generation batch.")
    session_timeout_ms: int = opt(
        15_000, "Consumer session timeout: how soon the group notices a dead producer and re-assigns its prompts.")
    max_batches: int = opt(0, "Stop after this many batches (0: run until stopped).")
    idle_timeout_s: float = opt(0.0, "Exit when no prompt arrives for this long (0: wait forever).")

    def validate(self) -> None:
        require(1 <= self.group_size <= 4096, "group_size: must be in [1, 4096]")
        require(self.prompts_per_batch >= 1, "prompts_per_batch: must be >= 1")
        require(self.max_backlog_groups >= 0, "max_backlog_groups: must be >= 0 (0 disables the limit)")
        require(self.max_version_lag >= -1, "max_version_lag: must be >= -1 (-1 disables the check)")
        require(self.backpressure_poll_s > 0, "backpressure_poll_s: must be > 0")
