"""The verifier on a real broker: shuffled and duplicated completions become exactly one ScoredGroup per group with
the right members and statistics; kill -9 loses no group; incomplete groups are resolved; garbage is dead-lettered."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from kafka import KafkaAdminClient

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import committed_offsets, make_consumer, make_producer
from grpo_core.stats import group_stats
from grpo_core.topics import ensure_topics
from grpo_verifiers.config import VerifierConfig

G = 4


def _cfg_dict(kafka_cfg: KafkaConfig, plan: PipelineContract, **extra: object) -> dict:
    return {"kafka": {"bootstrap": kafka_cfg.bootstrap}, "pipeline": {**to_dict(plan), "group_size": G},
            "metrics": {"port": -1}, **extra}


def completion(gid: str, index: int, answer: str, right: bool, attempt: str = "a") -> wire.Completion:
    tokens = np.arange(3, dtype=np.int32) + index
    return wire.Completion(
        group_id=gid, index=index, group_size=G, prompt_id=gid.split("@")[0], task="exact",
        prompt_token_ids=np.arange(4, dtype=np.int32), completion_token_ids=tokens,
        behaviour_logprobs=np.full(3, -1.0, dtype=np.float32), policy_version=0, producer_id="p",
        finish_reason="stop", prompt="max(1,2)=", completion=answer if right else "x",
        metadata={"answer": answer, "attempt": attempt})


def expected_rewards(gid: str) -> list[float]:
    """A deterministic pattern per group, including all-right and all-wrong groups."""
    k = int(gid[1:].split("@")[0])
    return [float((k >> i) & 1) for i in range(G)]


def send_groups(kafka_cfg: KafkaConfig, topic: str, gids: list[str], dup_share: float, seed: int) -> None:
    rng = random.Random(seed)
    records = [completion(g, i, str(i % 10), bool(expected_rewards(g)[i])) for g in gids for i in range(G)]
    records += rng.sample(records, int(dup_share * len(records)))  # re-deliveries
    rng.shuffle(records)  # groups interleave; a group's members arrive in any order
    producer = make_producer(kafka_cfg, "test")
    for c in records:
        producer.send(topic, key=c.group_id.encode(), value=wire.encode(c))
    producer.flush()
    producer.close()


def read_groups(kafka_cfg: KafkaConfig, topic: str, n: int, timeout_s: float = 120) -> list[wire.ScoredGroup]:
    consumer = make_consumer(kafka_cfg, "test", None, [topic])
    out: list[wire.ScoredGroup] = []
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        got = [wire.decode(m.value, wire.ScoredGroup) for msgs in consumer.poll(timeout_ms=300).values()
               for m in msgs]
        out += got
        if len(out) >= n:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 2.0:  # anything extra (a duplicate) would have arrived
                break
    consumer.close()
    return out


def read_letters(kafka_cfg: KafkaConfig, topic: str, n: int, timeout_s: float = 30) -> list[wire.DeadLetter]:
    """At least ``n`` dead letters of ``topic`` (fewer if they do not come within ``timeout_s``)."""
    consumer = make_consumer(kafka_cfg, "test", None, [topic])
    letters: list[wire.DeadLetter] = []
    deadline = time.monotonic() + timeout_s
    while len(letters) < n and time.monotonic() < deadline:
        letters += [wire.decode(m.value, wire.DeadLetter) for msgs in consumer.poll(timeout_ms=300).values()
                    for m in msgs]
    consumer.close()
    return letters


def check_group(g: wire.ScoredGroup, eps: float = 1e-4) -> None:
    assert [c.index for c in g.completions] == list(range(G)) and not g.partial
    assert g.rewards == expected_rewards(g.group_id)
    mean, std = group_stats(g.rewards, eps)
    assert (g.reward_mean, g.reward_std) == pytest.approx((mean, std))


def test_thousand_shuffled_groups_with_duplicates(kafka_cfg: KafkaConfig, plan: PipelineContract,
                                                  running: Callable) -> None:
    gids = [f"g{k}@e0r0" for k in range(1000)]
    send_groups(kafka_cfg, plan.topic("completions"), gids, dup_share=0.10, seed=0)
    v = running(load_config(VerifierConfig, None, [f"{k}={yaml.safe_dump(val, default_flow_style=True).strip()}"
                                                   for k, val in _cfg_dict(kafka_cfg, plan).items()]))
    groups = read_groups(kafka_cfg, plan.topic("groups"), 1000)
    assert Counter(g.group_id for g in groups) == Counter(gids), "exactly one ScoredGroup per group"
    for g in groups:
        check_group(g)
    assert v.metrics.dedup._value.get() >= 0.10 * 1000 * G * 0.9


@pytest.mark.slow
def test_kill9_loses_no_group(kafka_cfg: KafkaConfig, admin: KafkaAdminClient, plan: PipelineContract,
                              tmp_path: Path) -> None:
    gids = [f"g{k}@e0r0" for k in range(400)]
    send_groups(kafka_cfg, plan.topic("completions"), gids, dup_share=0.0, seed=1)
    path = tmp_path / "verifier.yaml"
    path.write_text(yaml.safe_dump(_cfg_dict(kafka_cfg, plan, idle_timeout_s=6, max_poll_records=16)))
    cmd = [sys.executable, "-m", "grpo_stream.cli", "verifier", "--config", str(path)]
    log = (tmp_path / "verifier.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(read_groups(kafka_cfg, plan.topic("groups"), 0, timeout_s=0.5)) < 40 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    assert proc.wait(timeout=240) == 0
    groups = read_groups(kafka_cfg, plan.topic("groups"), 400)
    counts = Counter(g.group_id for g in groups)
    assert set(counts) == set(gids), "no group lost"
    for g in groups:  # duplicates only as documented: groups completed above the watermark, rebuilt identically
        check_group(g)


def test_incomplete_groups_partial_or_dlq_and_garbage(kafka_cfg: KafkaConfig, plan: PipelineContract,
                                                      running: Callable) -> None:
    producer = make_producer(kafka_cfg, "test")
    for i in range(3):  # 3 of 4 members: published as partial after the timeout
        producer.send(plan.topic("completions"), key=b"g3@e0r0", value=wire.encode(completion("g3@e0r0", i, "1", True)))
    producer.send(plan.topic("completions"), key=b"g5@e0r0", value=wire.encode(completion("g5@e0r0", 0, "1", True)))
    producer.send(plan.topic("completions"), key=b"junk", value=b"\x00 not a completion")
    # Two attempts of one group (a producer re-ran it): never mixed; the first complete attempt wins.
    for i in range(2):
        producer.send(plan.topic("completions"), key=b"g7@e0r0", value=wire.encode(completion("g7@e0r0", i, "7", True,
                                                                                           attempt="old")))
    for i in range(G):
        producer.send(plan.topic("completions"), key=b"g7@e0r0", value=wire.encode(completion("g7@e0r0", i, "7", False,
                                                                                          attempt="new")))
    producer.flush()
    producer.close()
    running(load_config(VerifierConfig, None, [f"{k}={yaml.safe_dump(val, default_flow_style=True).strip()}"
                                               for k, val in _cfg_dict(kafka_cfg, plan, group_timeout_s=2.0).items()]))
    groups = {g.group_id: g for g in read_groups(kafka_cfg, plan.topic("groups"), 2)}
    assert set(groups) == {"g3@e0r0", "g7@e0r0"}
    assert groups["g3@e0r0"].partial and len(groups["g3@e0r0"].completions) == 3
    assert {c.metadata["attempt"] for c in groups["g7@e0r0"].completions} == {"new"}
    assert groups["g7@e0r0"].rewards == [0.0] * G
    letters = read_letters(kafka_cfg, plan.topic("dlq"), 2)
    reasons = " | ".join(d.reason for d in letters)
    assert "incomplete_group: g5@e0r0 has 1/4" in reasons and "not msgpack" in reasons


def _verifier_cfg(kafka_cfg: KafkaConfig, plan: PipelineContract, **extra: object) -> VerifierConfig:
    return load_config(VerifierConfig, None, [f"{k}={yaml.safe_dump(val, default_flow_style=True).strip()}"
                                              for k, val in _cfg_dict(kafka_cfg, plan, **extra).items()])


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_two_runs_on_one_broker_never_read_each_other(kafka_cfg: KafkaConfig, admin: KafkaAdminClient,
                                                      unique: Callable, running: Callable) -> None:
    """Names derive from the run: two runs' verifiers, side by side on one broker with default names otherwise,
    each score only their own run's completions and commit in their own consumer group."""
    runs = [PipelineContract(run=unique("run-a")), PipelineContract(run=unique("run-b"))]
    ids = [[f"g{k}@e0r0" for k in range(20)], [f"g{k}@e0r0" for k in range(100, 110)]]
    for contract, gids in zip(runs, ids, strict=True):
        ensure_topics(admin, contract)
        send_groups(kafka_cfg, contract.topic("completions"), gids, dup_share=0.0, seed=len(gids))
    for contract in runs:
        running(_verifier_cfg(kafka_cfg, contract))
    for contract, gids in zip(runs, ids, strict=True):
        groups = read_groups(kafka_cfg, contract.topic("groups"), len(gids))
        assert sorted(g.group_id for g in groups) == sorted(gids)
    assert runs[0].group("verifiers") != runs[1].group("verifiers")
    for contract, gids in zip(runs, ids, strict=True):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            committed = committed_offsets(admin, contract.group("verifiers"), contract.topic("completions"))
            if sum(committed.values()) == len(gids) * G:
                break
            time.sleep(0.3)
        assert sum(committed.values()) == len(gids) * G


def test_completions_of_another_group_size_are_dead_lettered(kafka_cfg: KafkaConfig, plan: PipelineContract,
                                                             running: Callable) -> None:
    """A producer run with another G than the contract: its completions go to the dlq naming both values."""
    producer = make_producer(kafka_cfg, "test")
    wrong = dataclasses.replace(completion("g9@e0r0", 0, "1", True), group_size=G + 2)
    producer.send(plan.topic("completions"), key=b"g9@e0r0", value=wire.encode(wrong))
    producer.flush()
    producer.close()
    running(_verifier_cfg(kafka_cfg, plan))
    letters = read_letters(kafka_cfg, plan.topic("dlq"), 1)
    assert letters and letters[0].reason == (f"group_size_mismatch: completion of g9@e0r0 says G={G + 2}, "
                                             f"the pipeline contract G={G}")


def test_a_group_too_large_for_its_topic_is_dead_lettered(kafka_cfg: KafkaConfig, admin: KafkaAdminClient,
                                                          unique: Callable, running: Callable) -> None:
    """G members of 1.5 MB each make a ScoredGroup the groups topic (4 MiB here) would refuse: the group goes to
    the dlq with the reason, the verifier goes on with the next group."""
    plan = PipelineContract(run=unique("big"))
    plan.topics.groups.max_message_bytes = 4 << 20
    ensure_topics(admin, plan)
    producer = make_producer(kafka_cfg, "test")
    for i in range(G):
        big = dataclasses.replace(completion("g1@e0r0", i, "1", True), prompt="x" * 1_500_000)
        producer.send(plan.topic("completions"), key=b"g1@e0r0", value=wire.encode(big))
    producer.flush()
    producer.close()
    send_groups(kafka_cfg, plan.topic("completions"), ["g2@e0r0"], dup_share=0.0, seed=5)
    v = running(_verifier_cfg(kafka_cfg, plan))
    assert [g.group_id for g in read_groups(kafka_cfg, plan.topic("groups"), 1)] == ["g2@e0r0"]
    letters = read_letters(kafka_cfg, plan.topic("dlq"), 1)
    assert letters and letters[0].reason.startswith("group_too_large: g1@e0r0 encodes to ")
    assert not v.stopping


def test_failed_rewards_are_marked_not_scored(kafka_cfg: KafkaConfig, plan: PipelineContract,
                                              running: Callable) -> None:
    """A reward that raises on some completions (after its retry) makes them failed members, not zeros: the
    group's statistics are over the members that have a score."""
    members = [dataclasses.replace(completion("f1@e0r0", i, str(i), True), task="buggy",
                                   completion=["0", "FAIL", "x", "3"][i]) for i in range(G)]
    producer = make_producer(kafka_cfg, "test")
    for c in members:
        producer.send(plan.topic("completions"), key=c.group_id.encode(), value=wire.encode(c))
    producer.flush()
    producer.close()
    rewards = {"by_task": {"buggy": [{"name": "reward_fixtures:fails_on_word"}]}, "workers": 1, "retries": 1}
    v = running(_verifier_cfg(kafka_cfg, plan, rewards=rewards))
    [g] = read_groups(kafka_cfg, plan.topic("groups"), 1)
    assert (g.failed, g.rewards) == ([1], [1.0, 0.0, 0.0, 1.0])
    assert (g.reward_mean, g.reward_std) == pytest.approx(group_stats([1.0, 0.0, 1.0], plan.stats_eps))
    assert g.reward_info["errors"] == ["exception: RuntimeError: cannot parse FAIL"]
    assert v.metrics.reward_failed._value.get() == 1
    assert v.pool.stats()["retried"] == 1


def test_a_trl_style_reward_function_scores_a_group(kafka_cfg: KafkaConfig, plan: PipelineContract,
                                                    running: Callable) -> None:
    """A reward function written for TRL's GRPOTrainer (``trl:reward_fixtures:trl_accuracy``) scores a group
    through the verifier, in the sandboxed pool; its None (member 2: the function does not apply) is a 0, not a
    failure."""
    answers, kinds = ["1", "2", "3", "4"], [None, None, "skip", None]
    members = []
    for i in range(G):
        c = completion("t1@e0r0", i, answers[i], i != 1)
        members.append(dataclasses.replace(c, task="trl", metadata={**c.metadata, "kind": kinds[i]}))
    producer = make_producer(kafka_cfg, "test")
    for c in members:
        producer.send(plan.topic("completions"), key=c.group_id.encode(), value=wire.encode(c))
    producer.flush()
    producer.close()
    rewards = {"by_task": {"trl": [{"name": "trl:reward_fixtures:trl_accuracy"}]}, "workers": 1}
    running(_verifier_cfg(kafka_cfg, plan, rewards=rewards))
    [g] = read_groups(kafka_cfg, plan.topic("groups"), 1)
    assert (g.rewards, g.failed) == ([1.0, 0.0, 0.0, 1.0], [])
    assert "errors" not in g.reward_info
