"""The producer's continuous loop (``weights.swap: inflight``): groups in flight, no batch barrier.

Up to ``max_inflight_groups`` prompt groups are in the engine at once. A prompt is taken from Kafka the moment a
group finishes, and each group is sent as soon as its G samples are done, so the longest sample of a batch no
longer holds up the rest. The loop does not wait for the broker's acks: a group counts as published (its prompt
done) once every ack has come in, checked on each turn of the loop, while the engine's freed slots already hold
new prompts. Newer weights are loaded under the requests in flight
(:meth:`~grpo_producers.backends.vllm_async.AsyncVLLMEngine.swap`); a completion then records the version
behind each of its tokens.

**The prompts' offset rule** (a low watermark, like the verifier's): groups finish out of order, so a prompt
offset is committed only when every prompt at or below it on its partition is done -- all G completions
acknowledged, or dead-lettered. Per partition the commit point is the lowest offset still in flight, or one
past the last prompt read when none is (:class:`PromptWatermark`), committed when it moved, at most every
``COMMIT_EVERY_S`` (and at once when the loop stops). A producer killed at any moment leaves every
unfinished prompt at or above its committed offset: re-read, never lost; prompts that had finished above it
are generated again under a new attempt id, which the verifier keeps apart.

**Stale work is aborted, not published**: a group whose oldest version is more than ``pipeline.max_staleness``
behind the newest announced version would be dropped by the learner (``grpo_core.staleness``), so it is aborted
in the engine and its prompt generated again at the current version (``aborted_stale_total``). Only when the
producer holds newer weights than the group: with none to offer, regenerating cannot help.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpo_core.kafka_io import Partition, commit_processed
from grpo_core.staleness import too_stale
from grpo_producers.backends.base import Sample, StreamingBackend
from grpo_producers.backpressure import pause_reason

if TYPE_CHECKING:
    from grpo_producers.service import Job, Producer, Sent

log = logging.getLogger("producer")
_GENERATION_ATTEMPTS = 2  # one retry for a group whose generation failed (an engine hiccup), then dead-letter
# The loop turns about once per finished group (60-90 times a second in `bench async`). Polling the weights
# announcements and committing the watermark (a synchronous broker round trip) on every turn was 44% of the loop
# thread's py-spy samples in the in-flight run profiled in docs/results/profile-producer.txt, and as many commits
# a second from every producer to the group coordinator. At these intervals a swap waits at most 50 ms, beside
# learner steps of 0.2 s or more, and a later commit costs only prompts generated again after a crash.
FOLLOW_EVERY_S = 0.05
COMMIT_EVERY_S = 0.25


@dataclass
class PromptWatermark:
    """Per partition, the prompt offsets taken and not yet done, and one past the last offset read."""

    pending: dict[Partition, set[int]] = field(default_factory=dict)
    read_up_to: dict[Partition, int] = field(default_factory=dict)

    def read(self, tp: Partition, next_offset: int) -> None:
        self.read_up_to[tp] = max(next_offset, self.read_up_to.get(tp, 0))

    def take(self, tp: Partition, offset: int) -> None:
        self.pending.setdefault(tp, set()).add(offset)

    def done(self, tp: Partition, offset: int) -> None:
        self.pending.get(tp, set()).discard(offset)

    def commit_points(self) -> dict[Partition, int]:
        """THE commit point of each partition (see the module docstring)."""
        return {tp: min(self.pending.get(tp) or {end}) for tp, end in self.read_up_to.items()}

    def forget(self, tp: Partition) -> None:
        """On revocation: the partition's new owner re-reads from the committed point."""
        self.pending.pop(tp, None)
        self.read_up_to.pop(tp, None)


@dataclass
class InFlight:
    """One prompt group in the engine."""

    key: str
    job: Job
    tp: Partition
    version: int  # the weights it started under: its oldest version
    started: float = field(default_factory=time.perf_counter)
    failures: int = 0


class ContinuousLoop:
    """Keep the engine full of groups, publish each as it finishes, swap weights under them."""

    def __init__(self, producer: Producer, engine: StreamingBackend) -> None:
        self.p, self.engine, self.cfg = producer, engine, producer.cfg
        self.limit = self.cfg.max_inflight_groups or max(1, engine.capacity() // self.cfg.pipeline.group_size)
        self.marks = PromptWatermark()
        self.flight: dict[str, InFlight] = {}
        self.unacked: list[tuple[InFlight, Sent, float]] = []  # (group, sends, gen s): prompts still pending
        self.published, self.submitted = 0, 0
        self._committed: dict[Partition, int] = {}
        self._reason, self._checked_at = "", 0.0
        self._followed_at, self._committed_at = float("-inf"), float("-inf")
        self._busy_at = time.perf_counter()
        self._starved_at: float | None = None  # when a take found no prompt while there was room
        log.info("continuous generation: up to %d groups in flight", self.limit)

    def run(self) -> int:
        p = self.p
        while not p.stopping and not (self.cfg.max_groups and self.published >= self.cfg.max_groups):
            self._follow_weights()
            took = self._admit()
            self._collect(0.0 if took else 0.1)
            self._confirm()
            self._commit()
            if self._idle_too_long(took):
                break
        self._drain()
        return self.published

    # ---- weights and staleness -------------------------------------------------------------------
    def _follow_weights(self) -> None:
        p, now = self.p, time.monotonic()
        if now - self._followed_at < FOLLOW_EVERY_S:
            return
        self._followed_at = now
        p.weights.poll()
        if p.weights.outdated:  # a newer version, or ours announced again with other bytes
            kv = self.cfg.weights.inflight_kv
            swap = p.try_swap(lambda model_dir, version: self.engine.swap(model_dir, version, kv))
            if swap is not None:  # in use from the engine's next step on
                p.metrics.swap_latency.observe(max(0.0, time.time() - swap.announced_at))
        p.metrics.newest_version.set(p.weights.newest_version)
        for g in [g for g in self.flight.values() if self._stale(g.version)]:
            if self.engine.abort(g.key):
                del self.flight[g.key]
                p.metrics.aborted_stale.inc()
                log.info("group %s of v%d is beyond max_staleness of v%d: generating it again at v%d",
                         g.job.task.group_id, g.version, p.weights.newest_version, p.weights.version)
                self._submit(g.job, g.tp)

    def _stale(self, oldest: int) -> bool:
        w = self.p.weights
        return oldest < w.version and too_stale(w.newest_version, oldest, self.cfg.pipeline.max_staleness)

    # ---- prompts in --------------------------------------------------------------------------------
    def _admit(self) -> bool:
        """Take prompts while there is room and backpressure allows; True if any was read."""
        room = self.limit - len(self.flight)
        if self._starved_at is not None:
            self.p.metrics.starved.inc(time.perf_counter() - self._starved_at)
            self._starved_at = None
        if room <= 0 or self._held_back():
            return False
        jobs, next_offsets = self.p.take_prompts(limit=room, timeout_ms=0 if self.flight else 200)
        if not next_offsets:
            self._starved_at = time.perf_counter()
        for tp, end in next_offsets.items():
            self.marks.read(tp, end)
        for job in jobs:
            tp = Partition(job.msg.topic, job.msg.partition)
            if job.msg.offset in self.marks.pending.get(tp, set()):
                continue  # re-delivered after a rebalance while still in flight here
            self.marks.take(tp, job.msg.offset)
            self._submit(job, tp)
        if next_offsets:
            self.p.last_prompt_at = time.monotonic()
        return bool(next_offsets)

    def _held_back(self) -> bool:
        """Backpressure, checked every ``backpressure_poll_s`` (each check costs broker round trips). The
        groups in flight count as backlog: they are groups the learner has not consumed yet."""
        p, now = self.p, time.monotonic()
        if now - self._checked_at >= self.cfg.backpressure_poll_s:
            if self._reason:
                p.metrics.paused.labels(reason=self._reason).inc(now - self._checked_at)
            self._checked_at = now
            knobs = p.knobs.refresh()
            backlog = p.measured_backlog(knobs)
            backlog = None if backlog is None else backlog + len(self.flight)
            self._reason = pause_reason(knobs, backlog, p.weights.version, p.weights.newest_version)
            if self._reason:
                p.liveness.progressed()  # held back on purpose: waiting for the learner is not a stall
        return bool(self._reason)

    def _submit(self, job: Job, tp: Partition, failures: int = 0) -> None:
        self.submitted += 1
        key = f"{job.task.group_id}#{self.submitted}"
        seed = self.cfg.sampling.seed
        self.flight[key] = InFlight(key, job, tp, self.p.weights.version, failures=failures)
        self.engine.submit(key, job.prompt_ids, self.cfg.pipeline.group_size, self.p.sampling,
                           self.p.weights.version, None if seed is None else seed + self.submitted * 4096)

    # ---- groups out --------------------------------------------------------------------------------
    def _collect(self, timeout: float) -> None:
        now = time.perf_counter()
        if self.flight:
            self.p.metrics.engine_busy.inc(now - self._busy_at)
        self._busy_at = now
        if not self.flight:
            time.sleep(timeout)  # nothing can finish: do not spin while held back
        for done in self.engine.finished(timeout if self.flight else 0.0):
            g = self.flight.pop(done.key, None)
            if g is None:
                continue  # aborted meanwhile
            if done.samples is None:
                self._failed(g, done.error)
            elif self._stale(min(s.spans[0][0] if s.spans else g.version for s in done.samples)):
                self.p.metrics.aborted_stale.inc()
                self._submit(g.job, g.tp)
            else:
                self._publish(g, done.samples)
        self.p.metrics.inflight.set(len(self.flight))

    def _publish(self, g: InFlight, samples: list[Sample]) -> None:
        """Send the group's completions and go on: waiting here for the acks would leave the engine's freed
        slots empty for a broker round trip per group. :meth:`_confirm` publishes it once acknowledged."""
        gen_s = time.perf_counter() - g.started
        self.unacked.append((g, self.p.send([(g.job, samples)], g.version, gen_s), gen_s))

    def _confirm(self, wait: bool = False) -> None:
        """Publish the sent groups whose acks are all in (``wait``: all of them); only then is a prompt done."""
        still: list[tuple[InFlight, Sent, float]] = []
        for g, sent, gen_s in self.unacked:
            if not (wait or sent.acknowledged()):
                still.append((g, sent, gen_s))
                continue
            tokens = self.p.confirm(sent)  # resends a failed send and waits for it, as the batch loop does
            self.marks.done(g.tp, g.job.msg.offset)
            self.published += 1
            self.p.failed_batches = 0
            self.p.metrics.batch_seconds.observe(gen_s)
            log.debug("group %s: %d tokens in %.2fs", g.job.task.group_id, tokens, gen_s)
        self.unacked = still

    def _failed(self, g: InFlight, error: BaseException | None) -> None:
        p = self.p
        p.metrics.generation_errors.inc()
        p.failed_batches += 1
        log.warning("generation of %s failed: %r", g.job.task.group_id, error)
        if p.failed_batches >= self.cfg.max_failed_batches * _GENERATION_ATTEMPTS:
            # Group after group fails: the engine is broken, not the prompts. Exit without dead-lettering or
            # committing them, so a restarted or another producer takes them.
            raise RuntimeError(f"generation failed for {p.failed_batches} groups in a row: the engine looks "
                               "broken; exiting so that the process is restarted (max_failed_batches)") from error
        if g.failures + 1 < _GENERATION_ATTEMPTS:
            self._submit(g.job, g.tp, g.failures + 1)
            return
        p.dead.send(g.job.msg, f"generation_error: prompt {g.job.task.prompt_id}: {error!r}"[:1000])
        self.marks.done(g.tp, g.job.msg.offset)

    # ---- offsets -----------------------------------------------------------------------------------
    def _commit(self, force: bool = False) -> None:
        """Commit each held partition's low watermark when it moved, at most every ``COMMIT_EVERY_S`` unless
        ``force``; forget partitions no longer held (every turn: their groups must stop at once)."""
        held = set(self.p.prompts.assignment())
        for tp in [tp for tp in self.marks.read_up_to if tp not in held]:
            for g in [g for g in self.flight.values() if g.tp == tp]:
                self.engine.abort(g.key)
                del self.flight[g.key]
            self.marks.forget(tp)
            self._committed.pop(tp, None)
        now = time.monotonic()
        if not force and now - self._committed_at < COMMIT_EVERY_S:
            return
        self._committed_at = now
        points = {tp: off for tp, off in self.marks.commit_points().items() if self._committed.get(tp) != off}
        # Every prompt below each point is published and acked, or dead-lettered: see the module docstring.
        if points and commit_processed(self.p.prompts, points):
            self._committed.update(points)

    def _idle_too_long(self, took: bool) -> bool:
        p = self.p
        if not p.prompts.assignment():  # idle only counts while we hold partitions (not mid-rebalance)
            p.last_prompt_at = time.monotonic()
            return False
        if took or self.flight or self.unacked:
            return False
        p.watch_lag()
        return bool(self.cfg.idle_timeout_s) and time.monotonic() - p.last_prompt_at > self.cfg.idle_timeout_s

    def _drain(self) -> None:
        """Finish what is in flight (at most ``stop_drain_s``), abort the rest, commit what is done."""
        deadline = time.monotonic() + self.cfg.stop_drain_s
        while self.flight and time.monotonic() < deadline:
            self._collect(0.2)
        for key in list(self.flight):
            self.engine.abort(key)
        self.flight.clear()
        self._confirm(wait=True)
        self._commit(force=True)
