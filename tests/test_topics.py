"""The declared topic plan on a real broker: created once, idempotent, conflicts named precisely."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kafka import KafkaAdminClient

from grpo_stream.config import TopicsConfig, TopicsFileConfig, load_config
from grpo_stream.topics import TopicConflict, broker_configs, ensure_topics, live_configs


def _plan(unique: Callable[[str], str]) -> TopicsConfig:
    prefix = unique("plan")
    overrides = [f"topics.{t}.name={prefix}-{t}" for t in
                 ("prompts", "completions", "groups", "weights", "weight_data", "dlq")]
    return load_config(TopicsFileConfig, None, overrides).topics


def test_create_is_idempotent_and_applies_configs(admin: KafkaAdminClient, unique: Callable) -> None:
    plan = _plan(unique)
    first = ensure_topics(admin, plan)
    assert [r.created for r in first] == [True] * 6
    second = ensure_topics(admin, plan)
    assert [r.created for r in second] == [False] * 6
    live = live_configs(admin, plan.weights.name)
    assert live["cleanup.policy"] == "compact"
    assert live["max.message.bytes"] == str(plan.weights.max_message_bytes)
    (meta,) = admin.describe_topics([plan.completions.name])
    assert len(meta["partitions"]) == plan.completions.partitions


def test_conflicting_existing_topic_is_reported_per_setting(admin: KafkaAdminClient, unique: Callable) -> None:
    plan = _plan(unique)
    spec = plan.groups
    wrong = dict(broker_configs(spec), **{"retention.ms": "1000"})
    admin.create_topics({spec.name: {"num_partitions": spec.partitions + 1, "replication_factor": 1,
                                     "configs": wrong}})
    admin.wait_for_topics([spec.name])
    with pytest.raises(TopicConflict) as info:
        ensure_topics(admin, plan)
    message = str(info.value)
    assert f"{spec.name}: partitions is {spec.partitions + 1}, plan says {spec.partitions}" in message
    assert f"{spec.name}: retention.ms is '1000'" in message
    assert plan.prompts.name not in message  # only the differing topic is named
