"""The producer's continuous loop (``weights.swap: inflight``) on a real broker and a real vLLM engine: groups
finish out of order and the prompts' low watermark never passes an unfinished prompt, not even across kill -9;
stale groups are aborted and generated again; completions spanning a swap carry both versions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import yaml
from kafka import KafkaAdminClient, TopicPartition
from test_producer_service import Running, _cfg, feed, other_weights, publisher_for, wait_for

from grpo_core import wire
from grpo_core.config import ConfigError, KafkaConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.kafka_io import committed_offsets, read_topic
from grpo_producers.config import ProducerConfig
from grpo_producers.continuous import PromptWatermark
from grpo_stream.tiny_model import build_tiny_model

G = 2
VLLM = ("backend.kind=vllm", "weights.swap=inflight", "max_inflight_groups=6", "pipeline.max_new_tokens=48")


# ------------------------------------------------------------------------------------------ the watermark


def test_the_watermark_waits_for_the_lowest_unfinished_prompt() -> None:
    tp, other = TopicPartition("p", 0), TopicPartition("p", 1)
    marks = PromptWatermark()
    for off in (3, 4, 5, 6):
        marks.take(tp, off)
    marks.read(tp, 7)
    marks.read(other, 2)  # read there, nothing in flight (dead-lettered or undecodable): done
    assert marks.commit_points() == {tp: 3, other: 2}
    for off in (6, 4, 5):  # finish out of order: the point stays at the oldest unfinished prompt
        marks.done(tp, off)
        assert marks.commit_points()[tp] == 3
    marks.done(tp, 3)
    assert marks.commit_points() == {tp: 7, other: 2}
    marks.read(tp, 5)  # offsets only move forward
    assert marks.commit_points()[tp] == 7
    marks.forget(tp)
    assert marks.commit_points() == {other: 2}


def test_a_sent_group_is_done_only_once_every_ack_is_in() -> None:
    """The loop sends a finished group and goes on generating; the prompt's offset may pass only once the
    broker has acknowledged all of its completions (a kill -9 before that re-reads the prompt)."""
    from types import SimpleNamespace

    from grpo_producers.continuous import ContinuousLoop, InFlight
    from grpo_producers.service import Sent

    class Future:
        is_done = False

    tp = TopicPartition("p", 0)
    confirmed: list[Sent] = []
    metrics = SimpleNamespace(batch_seconds=SimpleNamespace(observe=lambda s: None))
    loop = ContinuousLoop.__new__(ContinuousLoop)
    loop.p = SimpleNamespace(confirm=lambda sent: confirmed.append(sent) or sent.tokens, metrics=metrics,
                             failed_batches=0)
    loop.marks, loop.unacked, loop.published = PromptWatermark(), [], 0
    futures = {off: [Future(), Future()] for off in (10, 11)}
    for off in (10, 11):
        loop.marks.take(tp, off)
        job = SimpleNamespace(msg=SimpleNamespace(offset=off), task=SimpleNamespace(group_id=f"g{off}"))
        loop.unacked.append((InFlight(f"g{off}", job, tp, 0), Sent([(f, None) for f in futures[off]], 1, 5), 0.1))
    loop.marks.read(tp, 12)
    futures[11][0].is_done = futures[11][1].is_done = True  # the later group's acks are in, the earlier's not
    futures[10][0].is_done = True
    loop._confirm()
    assert loop.published == 1 and [s.futures[0][0] for s in confirmed] == [futures[11][0]]
    assert loop.marks.commit_points() == {tp: 10}  # not past the unacknowledged prompt
    futures[10][1].is_done = True
    loop._confirm()
    assert loop.published == 2 and loop.unacked == [] and loop.marks.commit_points() == {tp: 12}
    loop.marks.take(tp, 12)
    loop.marks.read(tp, 13)
    loop.unacked.append((InFlight("g12", SimpleNamespace(msg=SimpleNamespace(offset=12),
                                                         task=SimpleNamespace(group_id="g12")), tp, 0),
                         Sent([(Future(), None)], 1, 5), 0.1))
    loop._confirm(wait=True)  # stopping: confirm() waits for (or resends) what is still unanswered
    assert loop.published == 3 and loop.marks.commit_points() == {tp: 13}


def test_room_in_the_engine_with_no_prompt_to_take_counts_as_starved(monkeypatch: pytest.MonkeyPatch) -> None:
    """``starved_seconds_total`` counts from a take that found no prompt, while there was room and no backpressure,
    to the next turn: how long the feeder left the engine short of work. A take that reads an offset, a full
    engine and backpressure stop the count."""
    from types import SimpleNamespace

    from grpo_producers import continuous
    from grpo_producers.continuous import ContinuousLoop

    clock = [0.0]
    monkeypatch.setattr(continuous.time, "perf_counter", lambda: clock[0])
    tp = TopicPartition("p", 0)
    starved: list[float] = []
    takes = iter([([], {}), ([], {tp: 5}), ([], {}), ([], {}), ([], {tp: 6})])
    loop = ContinuousLoop.__new__(ContinuousLoop)
    loop.p = SimpleNamespace(take_prompts=lambda limit, timeout_ms: next(takes), last_prompt_at=0.0,
                             metrics=SimpleNamespace(starved=SimpleNamespace(inc=starved.append)))
    loop.limit, loop.flight, loop.marks, loop._starved_at = 2, {}, PromptWatermark(), None
    held = [False]
    loop._held_back = lambda: held[0]
    for at, full, hold in [(0.0, False, False), (0.5, False, False), (1.0, False, False), (1.25, True, False),
                           (2.0, False, False), (2.5, False, True), (3.0, False, False)]:
        clock[0], held[0] = at, hold
        loop.flight = {"a": None, "b": None} if full else {}
        loop._admit()
    # 0 -> 0.5 starved; 0.5 read an offset; 1.0 -> 1.25 starved, then full; 2.0 -> 2.5, then held back
    assert starved == [0.5, 0.25, 0.5] and loop._starved_at is None


def test_the_loop_polls_weights_and_commits_at_intervals_not_every_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop turns once per finished group; the weights are polled at most every ``FOLLOW_EVERY_S`` and the
    watermark committed at most every ``COMMIT_EVERY_S``, except when draining (then at once). A partition no
    longer held is forgotten on the turn it goes, interval or not."""
    from types import SimpleNamespace

    from grpo_producers import continuous
    from grpo_producers.continuous import COMMIT_EVERY_S, FOLLOW_EVERY_S, ContinuousLoop

    clock = [100.0]
    monkeypatch.setattr(continuous.time, "monotonic", lambda: clock[0])
    commits: list[dict[TopicPartition, int]] = []
    monkeypatch.setattr(continuous, "commit_processed", lambda consumer, points: commits.append(dict(points)) or True)
    polls: list[float] = []
    tp, gone = TopicPartition("p", 0), TopicPartition("p", 1)
    held = [{tp, gone}]
    loop = ContinuousLoop.__new__(ContinuousLoop)
    loop.p = SimpleNamespace(
        weights=SimpleNamespace(poll=lambda: polls.append(clock[0]), newest=None, version=1, newest_version=1,
                                outdated=False),
        prompts=SimpleNamespace(assignment=lambda: held[0]),
        metrics=SimpleNamespace(newest_version=SimpleNamespace(set=lambda v: None)))
    loop.flight, loop.marks, loop._committed = {}, PromptWatermark(), {}
    loop._followed_at, loop._committed_at = float("-inf"), float("-inf")
    loop.engine = SimpleNamespace(abort=lambda key: True)
    loop.marks.read(gone, 3)
    for turn, at in enumerate([0.0, 0.01, 0.02, FOLLOW_EVERY_S + 0.001, COMMIT_EVERY_S + 0.001]):
        clock[0] = 100.0 + at
        loop.marks.read(tp, 10 + turn)  # the watermark moves on every turn
        if turn == 2:
            held[0] = {tp}  # revoked between two commits: forgotten now, not at the next commit
        loop._follow_weights()
        loop._commit()
        if turn == 2:
            assert gone not in loop.marks.read_up_to
    assert polls == [100.0, 100.0 + FOLLOW_EVERY_S + 0.001, 100.0 + COMMIT_EVERY_S + 0.001]
    assert commits == [{tp: 10, gone: 3}, {tp: 14}]
    loop.marks.read(tp, 20)
    loop._commit(force=True)  # the drain's commit does not wait
    assert commits[-1] == {tp: 20}


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_the_loop_swaps_with_the_configured_kv_rule(kv: str) -> None:
    """``weights.inflight_kv`` reaches the engine's swap (the vLLM tests check what each rule does there)."""
    from types import SimpleNamespace

    from grpo_producers.continuous import ContinuousLoop

    swaps: list[tuple[Path, int, str]] = []
    cfg = load_config(ProducerConfig, None, ["backend.model=/m", "backend.kind=vllm", f"weights.inflight_kv={kv}"])
    newest = SimpleNamespace(version=3)
    weights = SimpleNamespace(poll=lambda: None, newest=newest, version=2, newest_version=3, outdated=True)
    observed: list[float] = []
    p = SimpleNamespace(
        weights=weights, try_swap=lambda load: load(Path("/w/v3"), 3) or SimpleNamespace(announced_at=0.0),
        metrics=SimpleNamespace(swap_latency=SimpleNamespace(observe=observed.append),
                                newest_version=SimpleNamespace(set=lambda v: None)))
    loop = ContinuousLoop.__new__(ContinuousLoop)
    loop.p, loop.cfg, loop.flight, loop._followed_at = p, cfg, {}, float("-inf")
    loop.engine = SimpleNamespace(swap=lambda model_dir, version, rule: swaps.append((model_dir, version, rule)))
    loop._follow_weights()
    assert swaps == [(Path("/w/v3"), 3, kv)] and len(observed) == 1
    with pytest.raises(ConfigError, match="inflight_kv"):
        load_config(ProducerConfig, None, ["backend.model=/m", "weights.inflight_kv=reuse"])


def test_swap_mode_resolves_per_backend_and_refuses_inflight_without_an_engine() -> None:
    base = ["backend.model=/m"]
    assert load_config(ProducerConfig, None, base).swap_mode == "between_batches"  # hf: batch path only
    assert load_config(ProducerConfig, None, [*base, "backend.kind=vllm"]).swap_mode == "inflight"
    assert load_config(ProducerConfig, None, [*base, "backend.kind=vllm", "weights.swap=between_batches"]
                       ).swap_mode == "between_batches"
    with pytest.raises(ConfigError, match="hf has no continuous engine"):
        load_config(ProducerConfig, None, [*base, "weights.swap=inflight"])
    with pytest.raises(ConfigError, match="max_inflight_groups"):
        load_config(ProducerConfig, None, [*base, "max_inflight_groups=-1"])


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    return build_tiny_model(tmp_path_factory.mktemp("tiny-continuous"))


def by_offset(kafka_cfg: KafkaConfig, plan: PipelineContract) -> dict[tuple[int, int], str]:
    """(partition, offset) -> group id of every prompt on the prompts topic."""
    return {(m.partition, m.offset): wire.decode(m.value, wire.PromptTask).group_id
            for m in read_topic(kafka_cfg, plan.topic("prompts"))}


def groups_done(kafka_cfg: KafkaConfig, plan: PipelineContract) -> tuple[set[str], list[wire.Completion]]:
    """Group ids with all G members of one attempt on the completions topic, and every completion."""
    got = [wire.decode(m.value, wire.Completion) for m in read_topic(kafka_cfg, plan.topic("completions"))]
    members: dict[tuple[str, str], set[int]] = defaultdict(set)
    for c in got:
        members[(c.group_id, c.metadata["attempt"])].add(c.index)
    return {gid for (gid, _), idx in members.items() if len(idx) == G}, got


def assert_watermark_kept(kafka_cfg: KafkaConfig, admin: KafkaAdminClient, plan: PipelineContract) -> int:
    """Every prompt below the committed offsets has a whole group published; returns how many are committed."""
    committed = committed_offsets(admin, plan.group("producers"), plan.topic("prompts"))
    done, _ = groups_done(kafka_cfg, plan)
    below = [gid for (part, off), gid in by_offset(kafka_cfg, plan).items() if off < committed.get(part, 0)]
    missing = [gid for gid in below if gid not in done]
    assert not missing, f"committed past unfinished prompts {missing[:5]}"
    return len(below)


# ------------------------------------------------------------------------------------------ on the broker


@pytest.mark.slow
def test_out_of_order_groups_and_kill9_lose_no_prompt(model_dir: Path, kafka_cfg: KafkaConfig,
                                                     admin: KafkaAdminClient, plan: PipelineContract,
                                                     tmp_path: Path) -> None:
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, *VLLM, "idle_timeout_s=8")
    path = tmp_path / "continuous.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    ids = feed(kafka_cfg, plan, 40)
    cmd = [sys.executable, "-m", "grpo_stream.cli", "producer", "--config", str(path)]
    log = (tmp_path / "producer.log").open("ab")
    # A session of its own, killed as a whole: kill -9 of the producer and its vLLM engine processes (which do
    # not watch their parent), as when a pod or the supervisor's reap takes them down together.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: len(groups_done(kafka_cfg, plan)[0]) >= 8, timeout_s=180, what="some groups")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.0)
    committed = assert_watermark_kept(kafka_cfg, admin, plan)
    assert committed < len(ids), "killed too late to test anything"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    assert proc.wait(timeout=300) == 0, (tmp_path / "producer.log").read_text()[-3000:]
    done, got = groups_done(kafka_cfg, plan)
    assert done == set(ids), "every prompt's whole group is there"
    assert assert_watermark_kept(kafka_cfg, admin, plan) == len(ids)
    # Groups really finished out of order: publish order differs from prompt order on some partition.
    order = by_offset(kafka_cfg, plan)
    rank = {gid: off for (_, off), gid in order.items()}
    part = {gid: p for (p, _), gid in order.items()}
    firsts: dict[int, list[str]] = defaultdict(list)
    for c in got:
        if c.index == 0 and c.group_id not in firsts[part[c.group_id]]:
            firsts[part[c.group_id]].append(c.group_id)
    assert any(seq != sorted(seq, key=rank.__getitem__) for seq in firsts.values()), "no group overtook another"


@pytest.mark.slow
def test_stale_groups_are_aborted_and_generated_again(model_dir: Path, kafka_cfg: KafkaConfig,
                                                     plan: PipelineContract, tmp_path: Path) -> None:
    cfg = _cfg(model_dir, kafka_cfg, plan, tmp_path, *VLLM, "pipeline.max_staleness=1", "max_version_lag=1",
               "pipeline.max_new_tokens=200", "sampling.max_tokens=200")
    ids = feed(kafka_cfg, plan, 12)
    files = other_weights(tmp_path)
    publisher = publisher_for(cfg, kafka_cfg)
    run = Running(cfg)
    try:
        p = run.producer
        wait_for(lambda: p.metrics.inflight._value.get() >= 3, timeout_s=120, what="groups in flight")
        for version in (1, 2, 3):  # a learner two steps ahead of every group in flight: all of them stale
            publisher.announce(publisher.publish(version, files))
        wait_for(lambda: p.weights.version == 3, what="the swap to v3")
        swapped_at = time.time()
        wait_for(lambda: len(groups_done(kafka_cfg, plan)[0]) == len(ids), timeout_s=240, what="every group")
        aborted = p.metrics.aborted_stale._value.get()
    finally:
        run.stop()
        publisher.close()
    assert aborted >= 1
    _, got = groups_done(kafka_cfg, plan)
    assert Counter((c.group_id, c.index) for c in got) == {(g, i): 1 for g in ids for i in range(G)}, \
        "aborted groups are never published; each prompt's group once"
    late = [c for c in got if c.timings["published_at"] > swapped_at + 0.5]
    assert late and all(c.policy_version >= 3 - 1 for c in late), "nothing beyond max_staleness after the swap"
    spans = [c for c in got if c.later_versions]
    assert all(c.policy_version < c.newest_version <= 3 for c in spans)
