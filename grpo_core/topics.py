"""Creating the declared topic plan (the pipeline contract's ``topics``, with its names) on a cluster, idempotently.

The same plan feeds the Kubernetes ``KafkaTopic`` manifests, so the broker-side settings of a topic are
derived in exactly one function, :func:`broker_configs`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import TopicAlreadyExistsError

from grpo_core.config import KafkaConfig, TopicSpec, opt
from grpo_core.contract import PipelineContract

log = logging.getLogger(__name__)


@dataclass
class TopicsFileConfig:
    """What ``grpo-stream topics create --config FILE`` reads (any role's config with these keys works)."""

    kafka: KafkaConfig = opt(factory=KafkaConfig, help="Cluster connection.")
    pipeline: PipelineContract = opt(factory=PipelineContract, help="The run: its topic plan and names.")


class TopicConflict(RuntimeError):
    """A topic exists with settings different from the plan (the message lists each difference)."""


@dataclass(frozen=True)
class TopicResult:
    name: str
    created: bool


def broker_configs(spec: TopicSpec) -> dict[str, str]:
    """The topic-level broker configs a spec implies (strings, as the admin API and Strimzi want them)."""
    return {
        "cleanup.policy": spec.cleanup_policy,
        "retention.ms": str(spec.retention_ms),
        "max.message.bytes": str(spec.max_message_bytes),
    }


def ensure_topics(admin: KafkaAdminClient, contract: PipelineContract) -> list[TopicResult]:
    """Create every missing topic of the plan; check existing ones against it.

    Raises :class:`TopicConflict` naming each differing setting, and never alters an existing topic: a
    changed partition count reshuffles keys across partitions, which the user must decide on knowingly.
    """
    plan = contract.topic_plan()
    existing = set(admin.list_topics())
    results = []
    missing = [s for s in plan if s.name not in existing]
    if missing:
        # A concurrent creator may win the race; the check below still compares its settings with the plan.
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics({s.name: {"num_partitions": s.partitions, "replication_factor": s.replication_factor,
                                          "configs": broker_configs(s)} for s in missing})
        admin.wait_for_topics([s.name for s in missing], timeout_ms=30_000)
        results += [TopicResult(s.name, True) for s in missing]
    present = [s for s in plan if s.name in existing]
    problems = [p for s in present for p in differences(admin, s)]
    if problems:
        raise TopicConflict("existing topics differ from the plan:\n  " + "\n  ".join(problems)
                            + "\nchange the config to match, or delete/alter the topic deliberately")
    return results + [TopicResult(s.name, False) for s in present]


def differences(admin: KafkaAdminClient, spec: TopicSpec) -> list[str]:
    """Human-readable differences between a live topic and its spec."""
    (meta,) = admin.describe_topics([spec.name])
    parts = meta["partitions"]
    out = []
    if len(parts) != spec.partitions:
        out.append(f"{spec.name}: partitions is {len(parts)}, plan says {spec.partitions}")
    replicas = len(parts[0]["replica_nodes"]) if parts else 0
    if replicas != spec.replication_factor:
        out.append(f"{spec.name}: replication factor is {replicas}, plan says {spec.replication_factor}")
    live = live_configs(admin, spec.name)
    for key, want in broker_configs(spec).items():
        if live.get(key) != want:
            out.append(f"{spec.name}: {key} is {live.get(key)!r}, plan says {want!r}")
    return out


def live_configs(admin: KafkaAdminClient, topic: str) -> dict[str, str | None]:
    resource = ConfigResource(ConfigResourceType.TOPIC, topic)
    described = admin.describe_configs([resource], config_filter="all")
    entries = next(iter(next(iter(described.values())).values()))
    return {k: (v.get("value") if isinstance(v, dict) else v) for k, v in entries.items()}
