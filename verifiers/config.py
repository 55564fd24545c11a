"""The verifier's typed config (``grpo-stream verifier --config FILE [key=value ...]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_core.config import KafkaConfig, MetricsConfig, opt, require
from grpo_core.contract import PipelineContract
from grpo_verifiers.rewards import RewardConfig


@dataclass
class VerifierConfig:
    """One scoring worker: completions in, one ScoredGroup per group of G out."""

    verifier_id: str = opt("", "Stamped on every ScoredGroup. Empty: <hostname>-<pid>.")
    pipeline: PipelineContract = opt(factory=PipelineContract, help="What every role agrees on (grpo_core.contract).")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    metrics: MetricsConfig = opt(factory=MetricsConfig, help="/metrics and /health endpoint.")
    rewards: RewardConfig = opt(factory=RewardConfig, help="Which rewards, and the sandboxed worker pool.")
    group_timeout_s: float = opt(300.0, "A group still incomplete this long after its first member is resolved.")
    on_timeout: Literal["partial", "drop"] = opt(
        "partial", "partial: publish it (marked partial) if it has >= min_group_size members, else dlq; drop: dlq.")
    min_group_size: int = opt(
        2, "Smallest partial group worth publishing (a group of 1 has no variance). In [1, pipeline.group_size].")
    max_poll_records: int = opt(512, "Completions read per poll (one scoring batch at most).")
    poll_timeout_ms: int = opt(200, "Kafka poll timeout.")
    idle_timeout_s: float = opt(
        0.0, "Exit after this long without a completion while holding partitions (0: run until stopped).")
    session_timeout_ms: int = opt(
        15_000, "Consumer session timeout: how soon the group notices a dead verifier and re-assigns its partitions.")

    def validate(self) -> None:
        require(self.group_timeout_s > 0, "group_timeout_s: must be > 0")
        require(self.min_group_size >= 1, "min_group_size: must be >= 1")
        g = self.pipeline.group_size
        require(self.min_group_size <= g,
                f"min_group_size: {self.min_group_size} is above pipeline.group_size={g}, so no partial group could "
                f"ever be published; set it in [1, {g}]")
        require(self.max_poll_records >= 1, "max_poll_records: must be >= 1")
