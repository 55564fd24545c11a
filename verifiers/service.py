"""The verifier process: completions -> rewards -> one ScoredGroup per group (``grpo-stream verifier``).

Per poll: decode (dead-letter garbage) -> assemble groups (``grpo_verifiers.assembly``; duplicates ignored) ->
resolve groups past ``group_timeout_s`` (partial or dlq) -> score every completed group's members in the
sandboxed reward pool -> publish the ScoredGroups and wait for the acks -> commit each partition's low
watermark (``GroupAssembler.watermark``), the only offsets this service commits.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time

from grpo_core import wire
from grpo_core.config import load_config
from grpo_core.kafka_io import (
    DEAD_LETTER_OVERHEAD_BYTES,
    DeadLetters,
    Partition,
    RebalanceListener,
    Record,
    acked,
    assigned_lag,
    commit_processed,
    make_consumer,
    make_producer,
    poll,
)
from grpo_core.metrics import Liveness
from grpo_core.process import serve
from grpo_core.stats import group_stats
from grpo_verifiers.assembly import GroupAssembler, Ready
from grpo_verifiers.config import VerifierConfig
from grpo_verifiers.metrics import VerifierMetrics
from grpo_verifiers.rewards import RewardPool, RewardRequest, RewardResult

log = logging.getLogger("verifier")


class _Rebalance(RebalanceListener):  # type: ignore[misc]  # kafka-python has no type hints
    """Forgets the pending groups of partitions this verifier lost in a rebalance.

    No commit here: kafka-python 3 runs listeners on its IO thread, where a blocking commit is refused. Every
    loop iteration already committed what is done, so the next owner re-reads at most the last iteration's
    records (rebuilt groups, deduplicated downstream). Partitions that come straight back keep their pending
    groups: whether or not the client rewinds them to the committed offset, re-read members are duplicates.
    """

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self.revoked: set[int] = set()

    def on_partitions_revoked(self, revoked: list[Partition]) -> None:
        self.revoked |= {tp.partition for tp in revoked}

    def on_partitions_assigned(self, assigned: list[Partition]) -> None:
        kept = {tp.partition for tp in assigned}
        for partition in self.revoked - kept:
            self.verifier.assembler.forget_partition(partition)
        self.revoked = set()
        log.info("assigned %s", sorted(kept))


class Verifier:
    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self.id = cfg.verifier_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = VerifierMetrics()
        self.pool = RewardPool(cfg.rewards)
        self.sender = make_producer(cfg.kafka, "verifier")
        self.dead = DeadLetters(self.sender, cfg.pipeline.topic("dlq"), "verifier",
                                on_dead=lambda reason: self.metrics.dead.labels(reason=reason).inc(),
                                max_record_bytes=cfg.pipeline.record_limit("dlq", cfg.kafka))
        # Record batch headers and the key ride on top of the encoded group.
        self.group_limit = cfg.pipeline.record_limit("groups", cfg.kafka) - DEAD_LETTER_OVERHEAD_BYTES
        self.assembler = GroupAssembler()
        self.consumer = make_consumer(cfg.kafka, "verifier", cfg.pipeline.group("verifiers"),
                                      [cfg.pipeline.topic("completions")], listener=_Rebalance(self),
                                      session_timeout_ms=cfg.session_timeout_ms,
                                      heartbeat_interval_ms=max(1000, cfg.session_timeout_ms // 5))
        self.stopping = False
        self.liveness = Liveness(cfg.metrics.stall_s)
        self.last_completion_at = time.monotonic()
        self._restarts_seen = 0
        self._lag_at = 0.0

    def run(self) -> None:
        while not self.stopping:
            polled = poll(self.consumer, self.cfg.poll_timeout_ms, self.cfg.max_poll_records)
            ready = self._assemble(polled)
            ready += self._resolve_expired()
            if ready:
                self._score_and_publish(ready)
            self.commit()
            self.metrics.pending.set(len(self.assembler.pending))
            if polled:
                self.liveness.progressed()
            if polled or not self.consumer.assignment():  # idle counts only while we hold partitions
                self.last_completion_at = time.monotonic()
            elif self.cfg.idle_timeout_s and time.monotonic() - self.last_completion_at > self.cfg.idle_timeout_s:
                break

    def _assemble(self, polled: dict[Partition, list[Record]]) -> list[Ready]:
        ready = []
        dedup_before = self.assembler.dedup_hits
        for tp, msgs in polled.items():
            for msg in msgs:
                c = self.dead.decode(msg, wire.Completion)
                if c is not None and c.group_size != self.cfg.pipeline.group_size:
                    self.dead.send(msg, f"group_size_mismatch: completion of {c.group_id} says G={c.group_size}, "
                                        f"the pipeline contract G={self.cfg.pipeline.group_size}")
                    c = None
                if c is None:
                    self.assembler.skip(tp.partition, msg.offset)
                    continue
                self.metrics.completions.inc()
                group = self.assembler.add(tp.partition, msg.offset, c, msg)
                if group is not None:
                    ready.append(group)
        self.metrics.dedup.inc(self.assembler.dedup_hits - dedup_before)
        return ready

    def _resolve_expired(self) -> list[Ready]:
        """Groups whose producer never finished them: publish as partial, or dead-letter (configurable)."""
        ready = []
        for g in self.assembler.expired(self.cfg.group_timeout_s):
            best = g.best()
            if self.cfg.on_timeout == "partial" and len(best) >= self.cfg.min_group_size:
                ready.append(Ready(g.group_id, g.partition, [best[i] for i in sorted(best)], partial=True))
                continue
            first = best[min(best)]
            self.dead.send(first.msg, f"incomplete_group: {g.group_id} has {len(best)}/{g.group_size} members "
                                      f"after {self.cfg.group_timeout_s:.0f}s")
            self.metrics.dropped.inc()
            self.assembler.done(g.partition, g.group_id)
        return ready

    def _score_and_publish(self, ready: list[Ready]) -> None:
        t0 = time.perf_counter()
        requests = [RewardRequest(completion=m.completion.completion, prompt=m.completion.prompt,
                                  task=m.completion.task, metadata=m.completion.metadata)
                    for r in ready for m in r.members]
        results = iter(self.pool.score_batch(requests))
        futures = []
        for r in ready:
            scored = [next(results) for _ in r.members]
            record = self._scored_group(r, scored)
            if record is None:
                continue
            value = wire.encode(record)
            if len(value) > self.group_limit:  # the broker would refuse it: dead-letter the group, never crash
                self.dead.send(r.members[0].msg, f"group_too_large: {r.group_id} encodes to {len(value)} bytes, "
                                                 f"more than the groups topic takes ({self.group_limit})")
                self.assembler.done(r.partition, r.group_id)
                continue
            send = functools.partial(self.sender.send, self.cfg.pipeline.topic("groups"), key=r.group_id.encode(),
                                     value=value)
            futures.append((r, send(), send))
            self._observe(record, scored)
        for r, future, send in futures:  # acked before the group counts as done (and its offsets may be committed)
            acked(future, send, f"verifier: group {r.group_id}")
            self.assembler.done(r.partition, r.group_id)
        self.metrics.groups_per_s.set(len(futures) / max(time.perf_counter() - t0, 1e-9))

    def _scored_group(self, r: Ready, scored: list[RewardResult]) -> wire.ScoredGroup | None:
        rewards = [s.reward for s in scored]
        failed = [k for k, s in enumerate(scored) if s.failed]  # no score: kept out of the statistics
        valid = [s.reward for s in scored if not s.failed]
        mean, std = group_stats(valid, self.cfg.pipeline.stats_eps) if valid else (0.0, 0.0)
        first = r.members[0].completion
        oldest = min(m.completion.policy_version for m in r.members)  # members may start under newer weights
        errors = [s.error for s in scored if s.error]
        record = wire.ScoredGroup(
            group_id=r.group_id, prompt_id=first.prompt_id, task=first.task, policy_version=oldest,
            completions=[m.completion for m in r.members], rewards=rewards, reward_mean=mean, reward_std=std,
            verifier_id=self.id, group_size=first.group_size, partial=r.partial,
            reward_info={"errors": errors[:16]} if errors else {}, scored_at=wire.now(), failed=failed)
        try:
            record.validate()
        except wire.WireError as exc:  # e.g. members disagreeing on their version: never crash, dead-letter it
            self.dead.send(r.members[0].msg, f"invalid_group: {r.group_id}: {exc}")
            self.assembler.done(r.partition, r.group_id)
            return None
        return record

    def _observe(self, record: wire.ScoredGroup, scored: list[RewardResult]) -> None:
        m = self.metrics
        m.groups.labels(task=record.task).inc()
        m.reward_mean.labels(task=record.task).set(record.reward_mean)
        m.pass_rate.labels(task=record.task).set(sum(r >= 1.0 for r in record.rewards) / len(record.rewards))
        if record.partial:
            m.partial.inc()
        for s in scored:
            m.reward_seconds.observe(s.seconds)
            m.observe_reward(s.error, s.failed)
        restarts = int(self.pool.stats().get("restarts", 0))
        m.worker_restarts.inc(max(0, restarts - self._restarts_seen))
        self._restarts_seen = max(restarts, self._restarts_seen)

    def commit(self) -> None:
        """Commit each partition's low watermark: everything below it is published, deduplicated or dead."""
        topic = self.cfg.pipeline.topic("completions")
        offsets = {}
        for tp in self.consumer.assignment():
            mark = self.assembler.watermark(tp.partition)
            if mark is not None:
                offsets[Partition(topic, tp.partition)] = mark
        commit_processed(self.consumer, offsets)
        self._update_lag()

    def _update_lag(self) -> None:
        if time.monotonic() - self._lag_at < 2.0:  # an extra round trip: not on every poll
            return
        self._lag_at = time.monotonic()
        lag = assigned_lag(self.consumer)
        if lag is not None:
            self.metrics.lag.set(lag)
            self.liveness.waiting = lag > 0

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        for closer in (self.consumer.close, self.sender.close, self.pool.close):
            try:
                closer()
            except Exception as exc:  # closing is best effort
                log.warning("close: %s", exc)


def main(config: str | None, overrides: list[str], pipeline: str | None = None) -> int:
    cfg = load_config(VerifierConfig, config, overrides, pipeline_file=pipeline)
    verifier = Verifier(cfg)
    def health() -> tuple[bool, dict[str, object]]:
        live, detail = verifier.liveness.check()
        return not verifier.stopping and live, {"pending": len(verifier.assembler.pending), **detail}

    return serve(verifier.metrics.registry, cfg.metrics, health, verifier.run,
                 verifier.stop, verifier.close, "publishing what is complete, then stopping")
