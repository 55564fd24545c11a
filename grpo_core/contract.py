"""The pipeline contract: the settings every role must agree on, in one typed section.

Every role's config embeds it as ``pipeline:``. It is written once -- the ``pipeline:`` section of a run YAML
(``grpo-stream run`` hands the same one to every child), or one ``pipeline.yaml`` in a k8s ConfigMap that every
role loads with ``--pipeline FILE`` -- so the feeder, producers, verifiers and the learner cannot silently
disagree on the group size, the names of topics and consumer groups, the std epsilon, the longest completion or
the staleness bound. What can only be seen at run time is checked where it shows: a ScoredGroup whose G is not
the contract's is dead-lettered naming both values, and a producer refuses weights announced by a learner whose
contract :meth:`~PipelineContract.digest` differs from its own.

Names derive from the run: topic ``prompts`` of run ``exp7`` is ``exp7.prompts`` and the learner's consumer group
``exp7.learner``, so two runs on one cluster never read each other's records. ``prefix`` overrides that
(``prefix: ""`` gives the bare names, for a cluster whose topics an operator named by hand).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal, cast

from grpo_core.config import ConfigError, KafkaConfig, TopicsConfig, TopicSpec, opt, require

TopicKey = Literal["prompts", "completions", "groups", "weights", "weight_data", "dlq"]
GroupKey = Literal["producers", "verifiers", "learner"]
LogprobMode = Literal["sampling", "raw"]

# Kafka allows [a-zA-Z0-9._-] up to 249 characters in topic names; run names also become paths and record keys.
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{0,200}")


@dataclass
class ConsumerGroups:
    """Consumer-group names (before the prefix). The producers read the other two to measure the backlog."""

    producers: str = opt("producers", "The producers' group on prompts (N producers share the prompts).")
    verifiers: str = opt("verifiers", "The verifiers' group on completions.")
    learner: str = opt("learner", "The learner's group on groups: its lag is the backlog the producers watch.")


@dataclass
class PipelineContract:
    """What every role of one run must agree on (``grpo-stream config explain pipeline``)."""

    run: str = opt("grpo", "Run name: the key of the weight announcements and the default name prefix.")
    prefix: str | None = opt(
        None, "Prefix of every topic and consumer-group name. null: '<run>.'; '' : the bare names.")
    group_size: int = opt(16, "G: completions per prompt. Producers generate it, verifiers assemble it, the "
                              "learner refuses other sizes.")
    max_new_tokens: int = opt(256, "Most tokens per completion: the producers' sampling limit and the Dr.GRPO "
                                   "normaliser's default (loss.max_len_norm).")
    stats_eps: float = opt(1e-4, "eps inside sqrt(var + eps) of the group std (arXiv 2505.22257, eq. 2), for "
                                 "the verifiers' published std and the learner's advantages. In (0, 1). Differs "
                                 "from verl (unbiased std + 1e-6) and TRL (unbiased std + 1e-4): advantages here "
                                 "are ~3 % larger at G = 16 (docs/defaults.md).")
    max_staleness: int = opt(4, "The learner drops groups generated more than this many learner steps ago; "
                                "producers never run further ahead than this (-1: unbounded).")
    logprobs: LogprobMode = opt(
        "sampling", "Which distribution the behaviour logprobs and the learner's logprobs are of. sampling: the "
        "tempered one, log_softmax(logits / T), as TRL and verl (each completion records its T; the learner "
        "divides its logits by it); raw: T = 1 whatever the sampling temperature. Top-p / top-k truncation is "
        "refused with sampling: the engine's renormalised nucleus is a distribution the learner cannot recompute.")
    topics: TopicsConfig = opt(factory=TopicsConfig, help="The topic plan (names before the prefix).")
    groups: ConsumerGroups = opt(factory=ConsumerGroups, help="Consumer-group names (before the prefix).")

    def validate(self) -> None:
        check_run_name(self.run, "pipeline.run")
        require(self.prefix is None or bool(_PREFIX_RE.fullmatch(self.prefix)),
                f"pipeline.prefix: {self.prefix!r}: only [A-Za-z0-9._-] (Kafka topic-name characters)")
        require(1 <= self.group_size <= 4096, f"pipeline.group_size: must be in [1, 4096], got {self.group_size}")
        require(self.logprobs in ("sampling", "raw"), f"pipeline.logprobs: {self.logprobs!r} is not sampling or raw")
        require(self.max_new_tokens >= 1, f"pipeline.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        require(0.0 < self.stats_eps < 1.0, f"pipeline.stats_eps: must be in (0, 1) as in eq. 2 (1e-4 is usual), "
                                            f"got {self.stats_eps}")
        require(self.max_staleness >= -1, f"pipeline.max_staleness: must be >= -1, got {self.max_staleness}")
        for key in ("producers", "verifiers", "learner"):
            require(bool(getattr(self.groups, key)), f"pipeline.groups.{key}: must not be empty")

    @property
    def name_prefix(self) -> str:
        return f"{self.run}." if self.prefix is None else self.prefix

    def topic(self, key: TopicKey) -> str:
        """The full name of one topic of the plan, e.g. ``exp7.groups``."""
        return self.name_prefix + cast(str, getattr(self.topics, key).name)

    def group(self, key: GroupKey) -> str:
        """The full name of one consumer group, e.g. ``exp7.learner``."""
        return self.name_prefix + cast(str, getattr(self.groups, key))

    def topic_plan(self) -> list[TopicSpec]:
        """Every topic with its full name and broker settings (what ``topics create`` and k8s generate use)."""
        return [dataclasses.replace(spec, name=self.name_prefix + spec.name) for spec in self.topics.all()]

    def topic_spec(self, key: TopicKey) -> TopicSpec:
        return dataclasses.replace(cast(TopicSpec, getattr(self.topics, key)), name=self.topic(key))

    def record_limit(self, key: TopicKey, kafka: KafkaConfig) -> int:
        """The largest record a client may send to one topic: the client's limit or the topic's, the smaller."""
        return min(kafka.max_record_bytes, cast(int, getattr(self.topics, key).max_message_bytes))

    def digest(self) -> str:
        """A short hash of everything in the contract: equal digests mean the roles agree."""
        blob = json.dumps(dataclasses.asdict(self) | {"prefix": self.name_prefix}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_run_name(name: str, key: str) -> None:
    """A run name becomes topic and consumer-group names, a directory (runs/<name>) and record keys: only
    Kafka's topic-name characters, starting alphanumeric (no path separators, no '..')."""
    require(bool(_RUN_RE.fullmatch(name)),
            f"{key}: {name!r}: use 1-200 characters of [A-Za-z0-9._-], starting with a letter or digit (it names "
            f"topics, consumer groups and the run directory)")


def check_same_contract(mine: PipelineContract, theirs_digest: str, who: str) -> None:
    """Refuse to work with a role whose contract differs (an empty digest: a peer that does not say)."""
    if theirs_digest and theirs_digest != mine.digest():
        raise ConfigError(f"pipeline contract mismatch: {who} runs with contract {theirs_digest}, this process "
                          f"with {mine.digest()}; load the same pipeline section (run YAML `pipeline:` or the "
                          f"--pipeline file) in every role")


def check_staleness_bound(max_version_lag: int, contract: PipelineContract, where: str) -> None:
    """A producer allowed to run further behind the newest weights than the learner accepts generates groups
    that are dropped on arrival."""
    if contract.max_staleness < 0:
        return
    require(0 <= max_version_lag <= contract.max_staleness,
            f"{where}: {max_version_lag} with pipeline.max_staleness={contract.max_staleness}: producers "
            f"may fall at most max_staleness versions behind (set it in [0, {contract.max_staleness}]), or the "
            f"learner drops what they generate")
