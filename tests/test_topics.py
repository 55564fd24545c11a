"""The declared topic plan on a real broker: created once, idempotent, conflicts named precisely."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kafka import KafkaAdminClient

from grpo_core.config import load_config
from grpo_core.contract import PipelineContract
from grpo_core.topics import TopicConflict, TopicsFileConfig, broker_configs, ensure_topics, live_configs


def _plan(unique: Callable[[str], str]) -> PipelineContract:
    return load_config(TopicsFileConfig, None, [f"pipeline.run={unique('plan')}"]).pipeline


def test_create_is_idempotent_and_applies_configs(admin: KafkaAdminClient, unique: Callable) -> None:
    plan = _plan(unique)
    first = ensure_topics(admin, plan)
    assert [r.created for r in first] == [True] * 6
    second = ensure_topics(admin, plan)
    assert [r.created for r in second] == [False] * 6
    live = live_configs(admin, plan.topic("weights"))
    assert live["cleanup.policy"] == "compact"
    assert live["max.message.bytes"] == str(plan.topics.weights.max_message_bytes)
    (meta,) = admin.describe_topics([plan.topic("completions")])
    assert len(meta["partitions"]) == plan.topics.completions.partitions


def test_conflicting_existing_topic_is_reported_per_setting(admin: KafkaAdminClient, unique: Callable) -> None:
    plan = _plan(unique)
    spec = plan.topic_spec("groups")
    wrong = dict(broker_configs(spec), **{"retention.ms": "1000"})
    admin.create_topics({spec.name: {"num_partitions": spec.partitions + 1, "replication_factor": 1,
                                     "configs": wrong}})
    admin.wait_for_topics([spec.name])
    with pytest.raises(TopicConflict) as info:
        ensure_topics(admin, plan)
    message = str(info.value)
    assert f"{spec.name}: partitions is {spec.partitions + 1}, plan says {spec.partitions}" in message
    assert f"{spec.name}: retention.ms is '1000'" in message
    assert plan.topic("prompts") not in message  # only the differing topic is named
