"""The producer process: prompts -> G completions each -> the completions topic (``grpo-stream producer``).

Two loops over the same pieces, picked by ``weights.swap``: ``inflight`` (the default on vLLM) is the
continuous loop of :mod:`grpo_producers.continuous`; ``between_batches`` is the batch loop below.

Per batch: wait while backpressure says so (polling weight announcements meanwhile) -> hot-swap to newer
weights -> take up to ``prompts_per_batch`` prompts -> generate G samples each with one policy version ->
publish every completion and wait for the broker's acks -> only then commit the prompts' offsets
(``commit_processed``). A producer killed mid-batch leaves its prompts uncommitted, so the group re-delivers
them: a prompt is never lost; its completions may be published twice, identified downstream by
(group id, index), and ``metadata["attempt"]`` tells the two attempts apart.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer

from grpo_core import wire
from grpo_core.config import load_config
from grpo_core.kafka_io import (
    BrokerError,
    DeadLetters,
    Partition,
    Record,
    SendFuture,
    acked,
    assigned_lag,
    commit_processed,
    make_admin,
    make_consumer,
    make_producer,
    poll,
)
from grpo_core.metrics import Liveness
from grpo_core.process import reuse_freed_memory, serve
from grpo_core.retry import retry
from grpo_core.weights import WeightFetcher, WeightFetchError
from grpo_core.weights.subscriber import LagWatch, Swap, WeightSubscriber, label
from grpo_producers.backends import make_backend
from grpo_producers.backends.base import Sample, StreamingBackend
from grpo_producers.backpressure import Backlog, Knobs, LiveKnobs, pause_reason
from grpo_producers.config import ProducerConfig
from grpo_producers.continuous import ContinuousLoop
from grpo_producers.metrics import ProducerMetrics

log = logging.getLogger("producer")


def prompt_ids(tokenizer: Any, prompt: str, chat_template: bool) -> list[int]:
    """The token ids a prompt is generated from: as the user turn of the tokenizer's chat template (with the
    assistant's generation prompt) when ``chat_template`` is set and the tokenizer has one, else the plain text
    with the tokenizer's special tokens. ``return_dict=True`` whatever the transformers release: 5 returns a
    BatchEncoding by default and 4 a list, and only the dict's ``input_ids`` are the same in both."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
    else:
        encoded = tokenizer(prompt, add_special_tokens=True)
    return [int(t) for t in encoded["input_ids"]]


@dataclass
class Job:
    """One prompt of the current batch, ready to generate."""

    msg: Record
    task: wire.PromptTask
    prompt_ids: list[int]


@dataclass
class Sent:
    """Completions handed to the client, acks not yet checked (see :meth:`Producer.confirm`)."""

    futures: list[tuple[SendFuture, Callable[[], SendFuture]]]
    groups: int
    tokens: int

    def acknowledged(self) -> bool:
        """Every send has an answer (an ack or an error): :meth:`Producer.confirm` returns without waiting
        unless it has to resend."""
        return all(future.is_done for future, _ in self.futures)


class Producer:
    def __init__(self, cfg: ProducerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.producer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = ProducerMetrics()
        self.backend = make_backend(cfg.backend_config(), streaming=cfg.swap_mode == "inflight")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.backend.tokenizer or cfg.backend.model)
        self.sampling = cfg.sampling_params()
        self.sender = make_producer(cfg.kafka, "producer")
        self.dead = DeadLetters(self.sender, cfg.pipeline.topic("dlq"), "producer",
                                on_dead=lambda reason: self.metrics.dead.labels(reason=reason).inc(),
                                max_record_bytes=cfg.pipeline.record_limit("dlq", cfg.kafka))
        self.prompts = make_consumer(cfg.kafka, "producer", cfg.pipeline.group("producers"),
                                     [cfg.pipeline.topic("prompts")], max_poll_interval_ms=cfg.max_poll_interval_ms,
                                     session_timeout_ms=cfg.session_timeout_ms,
                                     heartbeat_interval_ms=max(1000, cfg.session_timeout_ms // 5))
        self.admin = make_admin(cfg.kafka, "producer")
        self.backlog = Backlog(self.admin, cfg.pipeline)
        self.knobs = LiveKnobs(Knobs(cfg.max_backlog_groups, cfg.version_lag), cfg.control_file, cfg.pipeline)
        stream_run = cfg.pipeline.run if cfg.weights.kind == "kafka" else None
        fetcher = WeightFetcher(cfg.weights, cfg.kafka, cfg.pipeline.topic("weight_data"), stream_run=stream_run)
        self.weights = WeightSubscriber(make_consumer(cfg.kafka, "producer-weights", None),
                                        cfg.pipeline.topic("weights"), cfg.pipeline.run, fetcher, cfg.initial_version,
                                        contract=cfg.pipeline.digest(),
                                        lag=LagWatch(cfg.version_lag, cfg.unhealthy_behind_s))
        self.weights.catch_up(cfg.weights_catchup_s)  # the first batch then waits for (and swaps to) the newest
        self.metrics.version.set(cfg.initial_version)
        self.stopping = False
        self.batches, self.failed_batches = 0, 0
        self.liveness, self._lag_at = Liveness(cfg.metrics.stall_s), 0.0
        self.last_prompt_at = time.monotonic()

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Batches (``between_batches``) or groups (``inflight``) published until stopped or done."""
        if self.cfg.swap_mode == "inflight":
            return ContinuousLoop(self, cast(StreamingBackend, self.backend)).run()
        while not self.stopping and not (self.cfg.max_batches and self.batches >= self.cfg.max_batches):
            swap = self.wait_until_allowed()
            if self.stopping:
                break
            jobs, next_offsets = self.take_prompts()
            self.watch_lag()
            if not next_offsets:
                if not self.prompts.assignment():  # idle only counts while we hold partitions (not mid-rebalance)
                    self.last_prompt_at = time.monotonic()
                elif self.cfg.idle_timeout_s and time.monotonic() - self.last_prompt_at > self.cfg.idle_timeout_s:
                    break
                continue
            self.last_prompt_at = time.monotonic()
            if jobs:
                self.generate_and_publish(jobs, swap)
            # Every polled prompt is now published (acked) or dead-lettered: its offset may be committed.
            commit_processed(self.prompts, next_offsets)
            self.batches += 1
        return self.batches

    def watch_lag(self) -> None:
        """Work is waiting while the prompts this producer holds have records it has not read (every few s)."""
        if time.monotonic() - self._lag_at >= 5.0:
            self._lag_at = time.monotonic()
            lag = assigned_lag(self.prompts)
            if lag is not None:
                self.liveness.waiting = lag > 0

    def wait_until_allowed(self) -> Swap | None:
        """Block while backpressure says so; swap weights whenever newer ones are announced."""
        swap = None
        while not self.stopping:
            knobs = self.knobs.refresh()
            self.weights.poll()
            swap = self.try_swap() or swap
            self.metrics.newest_version.set(self.weights.newest_version)
            backlog = self.measured_backlog(knobs)
            reason = pause_reason(knobs, backlog, self.weights.version, self.weights.newest_version)
            if not reason:
                return swap
            self.liveness.progressed()  # held back on purpose: waiting for the learner is not a stall
            log.info("paused (%s): backlog %s, version %d, newest %d", reason, backlog, self.weights.version,
                     self.weights.newest_version)
            time.sleep(self.cfg.backpressure_poll_s)
            self.metrics.paused.labels(reason=reason).inc(self.cfg.backpressure_poll_s)
        return swap

    def measured_backlog(self, knobs: Knobs) -> int | None:
        """The backlog in groups (None: the limit is off, nothing measured)."""
        if knobs.max_backlog_groups <= 0:
            return None
        try:
            backlog = self.backlog.groups()
        except BrokerError as exc:  # cannot tell how far ahead we are: wait rather than run away
            log.warning("backlog unknown (%s); pausing", exc)
            backlog = knobs.max_backlog_groups
        self.metrics.backlog.set(backlog)
        return backlog

    def try_swap(self, load: Callable[[Path, int], None] | None = None) -> Swap | None:
        """Fetch and ``load(model_dir, version)`` (default: the backend's between-batch load) the newest announced
        weights, if newer than ours."""
        if not self.cfg.follow_weights:
            return None
        skipped = self.weights.skipped
        try:
            swap = self.weights.maybe_swap(load or (lambda model_dir, _version: self.backend.load_weights(model_dir)))
        except WeightFetchError:
            self.metrics.weight_errors.inc()
            return None
        finally:
            self.metrics.versions_skipped.inc(self.weights.skipped - skipped)
        if swap is not None:
            self.metrics.version.set(swap.version)
            self.metrics.swap_load.observe(swap.load_s)
            log.info("now generating with weights %s (fetch+load %.2fs)", label(swap.version, swap.incarnation),
                     swap.load_s)
        return swap

    # ---- one batch ---------------------------------------------------------------------------------
    def take_prompts(self, limit: int | None = None, timeout_ms: int = 1000) -> tuple[list[Job], dict[Partition, int]]:
        """Poll up to ``limit`` (default: a batch of) prompts; dead-letter the ones that cannot be generated."""
        polled = poll(self.prompts, timeout_ms, limit or self.cfg.prompts_per_batch)
        jobs, next_offsets = [], {}
        for tp, msgs in polled.items():
            for msg in msgs:
                next_offsets[tp] = msg.offset + 1
                task = self.dead.decode(msg, wire.PromptTask)
                if task is None:
                    continue
                ids, reason = self._prompt_ids(task)
                if reason:
                    self.dead.send(msg, f"{reason}: prompt {task.prompt_id}")
                    continue
                jobs.append(Job(msg, task, ids))
        return jobs, next_offsets

    def _prompt_ids(self, task: wire.PromptTask) -> tuple[list[int], str]:
        if len(task.prompt_token_ids):
            ids = [int(t) for t in task.prompt_token_ids]
        elif not task.prompt.strip():
            return [], "empty_prompt"
        else:
            ids = prompt_ids(self.tokenizer, task.prompt, self.cfg.apply_chat_template)
        budget = self.backend.max_context() - (self.sampling.max_tokens or 0)
        if len(ids) > budget:
            return [], f"prompt_too_long: {len(ids)} tokens > {budget} (context - max_tokens)"
        if not ids:
            return [], "empty_prompt"
        return ids, ""

    def generate_and_publish(self, jobs: list[Job], swap: Swap | None) -> None:
        version = self.weights.version  # fixed for the whole batch: a group never spans two versions
        t0 = time.perf_counter()
        samples = self._generate([j.prompt_ids for j in jobs])
        gen_s = time.perf_counter() - t0
        if samples is None:
            self.failed_batches += 1
            if self.failed_batches >= self.cfg.max_failed_batches:
                # Batch after batch of different prompts fails: the engine is broken, not the prompts. Exit
                # without dead-lettering (or committing) this batch, so a restarted or another producer takes it.
                raise RuntimeError(f"generation failed for {self.failed_batches} batches in a row: the engine "
                                   f"looks broken; exiting so that the process is restarted (max_failed_batches)")
            for job in jobs:
                self.dead.send(job.msg, f"generation_error: prompt {job.task.prompt_id}")
            return
        self.failed_batches = 0
        tokens = self.publish(list(zip(jobs, samples, strict=True)), version, gen_s)
        if swap is not None:
            self.metrics.swap_latency.observe(max(0.0, time.time() - swap.announced_at))
        self.metrics.batch_seconds.observe(gen_s)
        self.metrics.tokens_per_s.set(tokens / max(gen_s, 1e-9))
        self.metrics.completions_per_s.set(len(jobs) * self.cfg.pipeline.group_size / max(gen_s, 1e-9))
        log.info("v%d: %d groups, %d tokens in %.2fs", version, len(jobs), tokens, gen_s)

    def publish(self, groups: list[tuple[Job, list[Sample]]], version: int, gen_s: float) -> int:
        """Send every completion of ``groups`` and wait for the broker's acks; the tokens published."""
        return self.confirm(self.send(groups, version, gen_s))

    def send(self, groups: list[tuple[Job, list[Sample]]], version: int, gen_s: float) -> Sent:
        """Send every completion of ``groups`` without waiting: they count as published once :meth:`confirm`
        has seen every ack (the continuous loop goes on generating meanwhile)."""
        futures: list[tuple[SendFuture, Callable[[], SendFuture]]] = []
        attempt = uuid.uuid4().hex[:12]
        for job, group in groups:
            for index, sample in enumerate(group):
                record = self._completion(job, index, sample, version, attempt, gen_s)
                send = functools.partial(self.sender.send, self.cfg.pipeline.topic("completions"),
                                         key=job.task.group_id.encode(), value=wire.encode(record))
                futures.append((send(), send))
        return Sent(futures, len(groups), sum(len(s.token_ids) for _, group in groups for s in group))

    def confirm(self, sent: Sent) -> int:
        """Wait for (or resend until) every ack of ``sent``; the tokens published."""
        for future, send in sent.futures:  # every completion acknowledged before the prompt offsets are committed
            acked(future, send, f"producer: completions of {self.cfg.pipeline.topic('prompts')}")
        self.metrics.tokens.inc(sent.tokens)
        self.metrics.completions.inc(len(sent.futures))
        self.metrics.groups.inc(sent.groups)
        self.liveness.progressed()
        return sent.tokens

    def _generate(self, prompts: list[list[int]]) -> list[list[Sample]] | None:
        """One retry for a failed batch (a transient engine hiccup); then the caller dead-letters it."""
        def attempt() -> list[list[Sample]]:
            try:
                return self.backend.generate(prompts, self.cfg.pipeline.group_size, self.sampling)
            except Exception:
                self.metrics.generation_errors.inc()
                raise

        try:
            return retry(attempt, "generation", attempts=2, backoff_s=0.5, transient=(Exception,))
        except Exception as exc:  # any engine failure: the batch's prompts must not crash the service
            log.exception("generation failed twice: %s", exc)
            return None

    def _completion(self, job: Job, index: int, sample: Sample, version: int, attempt: str,
                    gen_s: float) -> wire.Completion:
        t = job.task
        spans = sample.spans or ((version, 0),)  # (version, first token): more than one after an in-flight swap
        return wire.Completion(
            group_id=t.group_id, index=index, group_size=self.cfg.pipeline.group_size, prompt_id=t.prompt_id,
            task=t.task,
            prompt_token_ids=job.prompt_ids,  # type: ignore[arg-type]  # a list: encode packs it as the array
            completion_token_ids=sample.token_ids,
            behaviour_logprobs=sample.logprobs, policy_version=spans[0][0], producer_id=self.id,
            later_versions=[v for v, _ in spans[1:]], later_starts=[start for _, start in spans[1:]],
            finish_reason=sample.finish_reason, prompt=t.prompt, completion=sample.text, epoch=t.epoch,
            metadata={**t.metadata, "attempt": attempt}, logprob_temperature=self.cfg.logprob_temperature(),
            timings={"generate_s": gen_s, "published_at": time.time(), "prompt_created_at": t.created_at})

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        for closer in (self.prompts.close, self.weights.consumer.close, self.weights.fetcher.close,
                       self.sender.close, self.admin.close, self.backend.close):
            try:
                closer()
            except Exception as exc:  # closing is best effort; report and go on
                log.warning("close: %s", exc)


def main(config: str | None, overrides: list[str], pipeline: str | None = None) -> int:
    cfg = load_config(ProducerConfig, config, overrides, pipeline_file=pipeline)
    if cfg.weights.kind == "kafka":
        reuse_freed_memory()  # weight versions arrive as hundreds of multi-MiB buffers per GB
    producer = Producer(cfg)

    def run() -> None:
        unit = "groups" if cfg.swap_mode == "inflight" else "batches"
        log.info("producer %s stopped after %d %s", producer.id, producer.run(), unit)

    def health() -> tuple[bool, dict[str, object]]:
        refused, (live, detail) = producer.weights.refused, producer.liveness.check()
        current, lag = producer.weights.lag.check()
        ok = not producer.stopping and not refused and live and current and not producer.failed_batches
        return ok, {"version": producer.weights.version, "newest": producer.weights.newest_version,
                    "refused": refused, "failed_batches": producer.failed_batches, **lag, **detail}

    return serve(producer.metrics.registry, cfg.metrics, health, run, producer.stop,
                 producer.close, "finishing the groups in flight" if cfg.swap_mode == "inflight"
                 else "finishing the current batch")
