"""The producer's typed config (``grpo-stream producer --config FILE [key=value ...]``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from grpo_core.config import KafkaConfig, MetricsConfig, check_model_path, opt, require
from grpo_core.contract import PipelineContract, check_staleness_bound
from grpo_core.weights.config import WeightStoreConfig
from grpo_producers.backends.base import BackendConfig, KvOnSwap, SamplingConfig

SwapMode = Literal["auto", "inflight", "between_batches"]


@dataclass
class ProducerWeights(WeightStoreConfig):
    """Where announced weights come from (the shared store settings) and when the producer swaps to them."""

    swap: SwapMode = opt(
        "auto", "inflight: continuous generation (max_inflight_groups groups in the engine; each group published "
        "when it finishes) and new weights loaded under the requests in flight (pause -> reload -> resume; a "
        "completion may then span versions, recorded per token); between_batches: batches of prompts_per_batch, "
        "weights swapped only between them. auto: inflight on vllm, between_batches on hf (no continuous engine).")
    inflight_kv: KvOnSwap = opt(
        "keep", "weights.swap=inflight: what a request in flight keeps across a swap. keep (PipelineRL's choice): "
        "the KV cache of its prefix, computed with the older weights; later tokens are sampled by the new weights "
        "over it, and each token's recorded logprob is the one it was sampled with (the learner's ratio stays "
        "exact against the real behaviour). recompute: its prefix is recomputed with the new weights on resume, "
        "so later tokens are the new policy's exactly, at the cost of a prefill of every request in flight at "
        "every swap (on the 2-core CPU ~18% of continuous tokens/s against ~11% for keep: bench engine).")


@dataclass
class ProducerConfig:
    """One generation worker: prompts in, G completions per prompt out, weights hot-swapped."""

    producer_id: str = opt("", "Stamped on every completion. Empty: <hostname>-<pid>.")
    pipeline: PipelineContract = opt(factory=PipelineContract, help="What every role agrees on (grpo_core.contract).")
    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    metrics: MetricsConfig = opt(factory=MetricsConfig, help="/metrics and /health endpoint.")
    backend: BackendConfig = opt(factory=lambda: BackendConfig(model=""), help="Generation engine (hf|vllm).")
    sampling: SamplingConfig = opt(factory=SamplingConfig, help="Sampling parameters (max_tokens: at most "
                                                                "pipeline.max_new_tokens, the default).")
    weights: ProducerWeights = opt(factory=ProducerWeights, help="Where announced weights are fetched from, and "
                                                                 "when they are swapped in (weights.swap).")
    prompts_per_batch: int = opt(8, "weights.swap=between_batches: prompts taken per generation batch "
                                    "(batch = prompts x G sequences).")
    max_inflight_groups: int = opt(
        0, "weights.swap=inflight: prompt groups kept in the engine; a new prompt is taken the moment one "
           "finishes. 0: the engine's capacity, its max concurrent sequences // G.")
    max_groups: int = opt(0, "weights.swap=inflight: stop after publishing this many groups (0: run until stopped).")
    stop_drain_s: float = opt(
        20.0, "weights.swap=inflight: on stop, finish the groups in flight for at most this long; the rest are "
              "aborted, their prompts left uncommitted for the next producer.")
    max_backlog_groups: int = opt(
        0, "Pause while groups not yet consumed by the learner (+ unscored ones) reach this. 0: no limit. Live. "
        "Keep it >= the learner's groups_per_batch, or the learner never gets a full batch.")
    max_version_lag: int | None = opt(
        None, "Block while the newest announced version is ahead of ours by more than this; at most "
              "pipeline.max_staleness. null: pipeline.max_staleness (-1 there: off). Live.")
    control_file: str = opt(
        "", "Optional YAML with max_backlog_groups / max_version_lag, re-read when it changes (a mounted "
        "ConfigMap in k8s): the live knobs.")
    backpressure_poll_s: float = opt(1.0, "How often a paused producer re-checks offsets and weights.")
    initial_version: int = opt(0, "Policy version of the weights the backend starts with (the learner's v0).")
    weights_catchup_s: float = opt(
        60.0, "At start-up, read the weights topic to its end within this long (then exit with the reason), so the "
              "newest announced version is known, and loaded, before the first batch.")
    follow_weights: bool = opt(True, "Hot-swap to newer announced weights (when: weights.swap).")
    unhealthy_behind_s: float = opt(
        120.0, "/health turns 503 while the weights in use stay more than max_version_lag behind the newest "
               "announced version for this long (a fetch that keeps failing, a wedged consumer); keep it above a "
               "version's fetch + load time. 0: off.")
    apply_chat_template: bool = opt(False, "Wrap prompt text with the tokenizer's chat template when it has one.")
    max_poll_interval_ms: int = opt(600_000, "Consumer max.poll.interval: longer than one generation batch.")
    session_timeout_ms: int = opt(
        15_000, "Consumer session timeout: how soon the group notices a dead producer and re-assigns its prompts.")
    max_batches: int = opt(0, "weights.swap=between_batches: stop after this many batches (0: run until stopped).")
    max_failed_batches: int = opt(
        3, "Exit (to be restarted) when this many batches in a row fail to generate: a broken engine. Each failed "
           "batch before that is retried once, then its prompts are dead-lettered (one bad prompt fails one batch).")
    idle_timeout_s: float = opt(0.0, "Exit when no prompt arrives for this long (0: wait forever).")

    def validate(self) -> None:
        require(self.prompts_per_batch >= 1, "prompts_per_batch: must be >= 1")
        require(self.max_backlog_groups >= 0, "max_backlog_groups: must be >= 0 (0 disables the limit)")
        if self.max_version_lag is not None:
            check_staleness_bound(self.max_version_lag, self.pipeline, "max_version_lag")
        limit = self.pipeline.max_new_tokens
        require(self.sampling.max_tokens is None or self.sampling.max_tokens <= limit,
                f"sampling.max_tokens: {self.sampling.max_tokens} exceeds pipeline.max_new_tokens={limit}")
        require(self.backpressure_poll_s > 0, "backpressure_poll_s: must be > 0")
        require(self.weights_catchup_s > 0, "weights_catchup_s: must be > 0")
        require(self.unhealthy_behind_s >= 0, "unhealthy_behind_s: must be >= 0 (0: off)")
        require(self.max_failed_batches >= 1, "max_failed_batches: must be >= 1")
        require(self.max_inflight_groups >= 0, "max_inflight_groups: must be >= 0 (0: the engine's capacity)")
        require(self.max_groups >= 0, "max_groups: must be >= 0 (0: no limit)")
        require(self.stop_drain_s >= 0, "stop_drain_s: must be >= 0")
        require(self.swap_mode == "between_batches" or self.backend.kind == "vllm",
                f"weights.swap=inflight: backend.kind={self.backend.kind} has no continuous engine; use vllm, or "
                "weights.swap: between_batches (or auto)")
        s = self.sampling
        require(self.pipeline.logprobs != "sampling" or s.temperature == 0 or (s.top_p == 1 and s.top_k == 0),
                f"sampling.top_p={s.top_p} / top_k={s.top_k} with pipeline.logprobs=sampling: the engine's "
                "logprobs would be of the renormalised nucleus, which the learner cannot recompute; set top_p: 1 "
                "and top_k: 0, or pipeline.logprobs: raw")

    def check_paths(self) -> None:
        """What must exist on this machine before the producer starts (grpo_core.config.check_paths)."""
        check_model_path(self.backend.model, "backend.model")
        if self.backend.tokenizer:
            check_model_path(self.backend.tokenizer, "backend.tokenizer", need=None)

    @property
    def swap_mode(self) -> Literal["inflight", "between_batches"]:
        """weights.swap with auto resolved for the backend."""
        if self.weights.swap == "auto":
            return "inflight" if self.backend.kind == "vllm" else "between_batches"
        return self.weights.swap

    @property
    def version_lag(self) -> int:
        """The max_version_lag in force: the configured one, else the contract's staleness bound."""
        return self.pipeline.max_staleness if self.max_version_lag is None else self.max_version_lag

    def backend_config(self) -> BackendConfig:
        """The backend config with the contract's logprob mode."""
        return dataclasses.replace(self.backend, logprobs=self.pipeline.logprobs)

    def logprob_temperature(self) -> float:
        """What each completion records: the T its behaviour logprobs are at (0: raw)."""
        return self.sampling.temperature if self.pipeline.logprobs == "sampling" else 0.0

    def sampling_params(self) -> SamplingConfig:
        """Sampling with ``max_tokens`` resolved against the contract."""
        return dataclasses.replace(self.sampling, max_tokens=self.sampling.max_tokens or self.pipeline.max_new_tokens)
