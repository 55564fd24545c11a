"""The learner's source of groups on a real broker: what its consumer group shows while it waits, and the tail of a
finite feed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from kafka import KafkaAdminClient
from test_learner_service import G, synthetic_group

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import DeadLetters, consumer_lag, make_consumer, make_producer
from grpo_learner.source import GroupSource, SourceRules, lineage_entries


@pytest.fixture
def source(kafka_cfg: KafkaConfig, new_topic: Callable[..., str],
           unique: Callable[[str], str]) -> Iterator[Callable[[list[wire.ScoredGroup], int], GroupSource]]:
    made: list[GroupSource] = []
    producer = make_producer(kafka_cfg, "test")

    def make(groups: list[wire.ScoredGroup], max_staleness: int) -> GroupSource:
        topic = new_topic("groups")
        for g in groups:
            producer.send(topic, key=g.group_id.encode(), value=wire.encode(g))
        producer.flush()
        src = GroupSource(make_consumer(kafka_cfg, "learner", unique("learner")), topic,
                          DeadLetters(producer, new_topic("dlq"), "test"),
                          SourceRules(G, True, max_staleness, 0, False), 10_000)
        src.start(None, "earliest")
        made.append(src)
        return src

    yield make
    for src in made:
        src.consumer.close()
    producer.close()


def _stop_after(polls: int) -> Callable[[], bool]:
    left = [polls]

    def should_stop() -> bool:
        left[0] -= 1
        return left[0] < 0

    return should_stop


def test_stale_groups_leave_the_backlog_while_the_learner_waits(source: Callable, admin: KafkaAdminClient) -> None:
    """Lockstep (max_staleness 0): at step 1 the v0 groups can never be trained. While the learner waits for a
    batch, its consumer group already commits past them, so the producers' backlog (its lag) no longer counts
    them and they generate the fresh groups the learner waits for."""
    rng = np.random.default_rng(0)
    src = source([synthetic_group(f"s{i}@e0r0", 0, rng) for i in range(5)], 0)
    group = src.consumer.config["group_id"]
    assert src.next_batch(1, 4, _stop_after(6), 200) is None  # nothing trainable: still waiting
    assert sum(consumer_lag(admin, group, src.topic).values()) == 0
    assert src.position == {0: 0}  # accounted for (lineage, checkpoint) only when a step takes them


def test_a_fresh_group_does_not_keep_the_stale_ones_behind_it_in_the_backlog(source: Callable,
                                                                            admin: KafkaAdminClient) -> None:
    """The lockstep run stood still with the producers paused at backlog 22 of 16: one fresh group at the head of
    the queue kept the stale groups behind it counted. Everything read is committed past now; the fresh group
    waits in the learner's queue (and is trained by the next step), the stale ones leave the backlog."""
    rng = np.random.default_rng(1)
    groups = [synthetic_group("a@e0r0", 1, rng)] + [synthetic_group(f"s{i}@e0r0", 0, rng) for i in range(5)]
    src = source(groups, 0)
    assert src.next_batch(1, 4, _stop_after(6), 200) is None
    assert consumer_lag(admin, src.consumer.config["group_id"], src.topic) == {0: 0}
    assert src.position == {0: 0} and [i.group.group_id for i in src.queue][:1] == ["a@e0r0"]


def test_the_tail_of_a_finite_feed_is_flushed(source: Callable) -> None:
    rng = np.random.default_rng(2)
    src = source([synthetic_group(f"t{i}@e0r0", 0, rng) for i in range(3)], 4)
    t0 = time.monotonic()
    pick = src.next_batch(0, 8, _stop_after(200), 100, flush_after_s=1.0)
    assert pick is not None and [i.group.group_id for i in pick.trained] == ["t0@e0r0", "t1@e0r0", "t2@e0r0"]
    assert time.monotonic() - t0 >= 1.0 and pick.next_offsets == {0: 3}
    assert src.next_batch(0, 8, _stop_after(5), 100, flush_after_s=0.0) is None  # off: it waits for 8


def test_failed_rewards_leave_the_group_or_drop_it(source: Callable) -> None:
    """A member whose reward failed is no signal: it is gone before anything reads the rewards (statistics,
    zero-variance, loss), and a group left with fewer than min_valid_rewards members is dropped with a reason."""
    rng = np.random.default_rng(3)
    mostly = dataclasses.replace(synthetic_group("f0@e0r0", 0, rng), rewards=[1.0, 0.0, 0.0, 0.5], failed=[1, 2])
    barely = dataclasses.replace(synthetic_group("f1@e0r0", 0, rng), rewards=[1.0, 0.0, 0.0, 0.0], failed=[1, 2, 3])
    fine = synthetic_group("f2@e0r0", 0, rng)
    src = source([mostly, barely, fine], 4)
    pick = src.next_batch(0, 2, _stop_after(50), 100)
    assert pick is not None
    first, second = pick.trained
    assert [c.index for c in first.group.completions] == [mostly.completions[0].index, mostly.completions[3].index]
    assert (first.group.rewards, first.failed) == ([1.0, 0.5], 2)
    assert second.group.group_id == "f2@e0r0" and second.failed == 0
    assert [(i.group.group_id, i.reason) for i in pick.dropped] == [("f1@e0r0", "reward_failed")]
    trained, dropped = lineage_entries(pick, 0)
    assert trained[0]["reward_failed"] == 2 and "reward_failed" not in trained[1]
    assert dropped[0] | {"reward_failed": 3, "reason": "reward_failed"} == dropped[0]


def spanned(group: wire.ScoredGroup, later: list[int]) -> wire.ScoredGroup:
    """The group as partial rollout makes it: every member continued under ``later`` versions from token 1."""
    members = [dataclasses.replace(c, later_versions=later, later_starts=list(range(1, len(later) + 1)))
               for c in group.completions]
    return dataclasses.replace(group, completions=members)


def test_a_spanning_group_is_as_stale_as_its_oldest_version(source: Callable) -> None:
    """Staleness is measured from the oldest version behind a group's tokens; the lineage shows the newest; a
    newest version that was never announced is from the future like any other."""
    rng = np.random.default_rng(4)
    ok = spanned(synthetic_group("s0@e0r0", 2, rng), [3])
    future = spanned(synthetic_group("s1@e0r0", 2, rng), [3, 99])
    plain = synthetic_group("s2@e0r0", 4, rng)
    src = source([ok, future, plain], 2)
    src.newest_announced = 4
    pick = src.next_batch(4, 2, _stop_after(50), 100)
    assert pick is not None and [i.group.group_id for i in pick.trained] == ["s0@e0r0", "s2@e0r0"]
    assert pick.dropped[0].reason.startswith("future_version: v99 was never announced")
    trained, _ = lineage_entries(pick, 4)
    assert (trained[0]["version"], trained[0]["newest_version"], trained[0]["staleness"]) == (2, 3, 2)
    assert "newest_version" not in trained[1]


def test_a_tail_with_nothing_trainable_is_taken_as_drops(source: Callable) -> None:
    """Only stale groups left and nothing arriving: after ``flush_after_s`` they are taken with no group to
    train (the learner accounts for them without a step), instead of waiting for a batch that never comes."""
    rng = np.random.default_rng(5)
    src = source([synthetic_group(f"z{i}@e0r0", 0, rng) for i in range(3)], 2)
    pick = src.next_batch(5, 4, _stop_after(200), 100, flush_after_s=1.0)
    assert pick is not None and pick.trained == [] and pick.next_offsets == {0: 3}
    assert [(i.group.group_id, i.reason) for i in pick.dropped] == [(f"z{i}@e0r0", "stale") for i in range(3)]
