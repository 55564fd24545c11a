"""The feeder's typed config (``grpo-stream feed --config FILE [key=value ...]``), apart from the feeder so that it
loads and validates without the Kafka client or Prometheus (a typo is rejected in well under a second)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_core.config import KafkaConfig, MetricsConfig, opt, require
from grpo_core.contract import PipelineContract
from grpo_producers.datasets import HfConfig, JsonlConfig, Source, SyntheticConfig
from grpo_producers.reasoning_gym_source import ReasoningGymConfig
from grpo_producers.reasoning_gym_source import check as check_reasoning_gym


@dataclass
class FeederConfig:
    """One feeder process: a dataset, its epochs and order, where progress is saved."""

    name: str = opt("feeder", "Dataset/run name: prefix of content-hash prompt ids and of the state file name.")
    out_dir: str = opt("", "Directory of the default state file. Empty: .cache.")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    pipeline: PipelineContract = opt(factory=PipelineContract, help="What every role agrees on; publishes to "
                                                                   "the prompts topic.")
    metrics: MetricsConfig = opt(factory=MetricsConfig, help="/metrics and /health endpoint.")
    source: Source = opt("jsonl", "Which dataset section below is read: jsonl, hf, synthetic or reasoning_gym.")
    jsonl: JsonlConfig = opt(factory=JsonlConfig, help="source: jsonl settings.")
    hf: HfConfig = opt(factory=HfConfig, help="source: hf settings (local data only; needs `datasets`).")
    synthetic: SyntheticConfig = opt(factory=SyntheticConfig, help="source: synthetic settings (the demo tasks).")
    reasoning_gym: ReasoningGymConfig = opt(
        factory=ReasoningGymConfig, help="source: reasoning_gym settings (needs the reasoning-gym extra).")
    epochs: int = opt(1, "Passes over the dataset; 0: forever (then set max_ahead or rate_limit_per_s).")
    seed: int = opt(0, "Shuffle seed; each (epoch, round) gets its own permutation derived from it.")
    shuffle: bool = opt(True, "Shuffle each epoch; false: dataset order.")
    sample_rounds: int = opt(1, "Groups per prompt per epoch (each round is its own group id).")
    rate_limit_per_s: float = opt(0.0, "At most this many records per second, evenly spaced; 0: unlimited.")
    max_ahead: int = opt(
        0, "Pause while the producers' consumer group has this many unconsumed prompts (its lag); 0: no pause.")
    lag_poll_s: float = opt(1.0, "How often to re-check the lag while paused by max_ahead.")
    max_prompt_chars: int = opt(65536, "Skip (and count) prompts longer than this; 0: no cap. Token caps are "
                                       "the producer's job.")
    state_path: str = opt("", "Progress file. Empty: <out_dir or .cache>/feeder-<name>.json.")
    resume: bool = opt(True, "Continue from state_path; false: start at epoch 0 and overwrite it.")
    flush_every: int = opt(100, "Wait for the broker's acks and save the state every N records.")
    max_records: int = opt(0, "Stop (cleanly, state saved) after publishing this many records in this run; 0: no cap.")

    def validate(self) -> None:
        require(bool(self.name) and "/" not in self.name, "name: must be non-empty, without '/'")
        require(self.epochs >= 0, "epochs: must be >= 0 (0: forever)")
        require(self.sample_rounds >= 1, "sample_rounds: must be >= 1")
        require(self.rate_limit_per_s >= 0, "rate_limit_per_s: must be >= 0 (0: unlimited)")
        require(self.max_ahead >= 0 and self.max_prompt_chars >= 0 and self.max_records >= 0,
                "max_ahead/max_prompt_chars/max_records: must be >= 0")
        require(self.flush_every >= 1, "flush_every: must be >= 1")
        require(self.lag_poll_s > 0, "lag_poll_s: must be > 0")
        require(self.epochs > 0 or self.max_ahead > 0 or self.rate_limit_per_s > 0,
                "epochs: 0 (forever) needs max_ahead or rate_limit_per_s, or the topic fills as fast as the broker "
                "accepts records")
        if self.source == "jsonl":
            require(bool(self.jsonl.paths), "jsonl.paths: list the JSONL files to read (source: jsonl)")
        if self.source == "hf":
            require(bool(self.hf.path), "hf.path: a local dataset path (source: hf)")
        if self.source == "reasoning_gym":
            check_reasoning_gym(self.reasoning_gym)

    def resolved_state_path(self) -> Path:
        return Path(self.state_path or Path(self.out_dir or ".cache") / f"feeder-{self.name}.json")
