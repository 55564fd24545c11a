"""The sandbox: a small pool of worker processes that runs reward code so that no reward can take the verifier down.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one hung task -- a killed worker breaks the
whole executor. Here each worker owns one duplex ``Pipe``; the verifier sends it a chunk of records and reads one
reply per record. Each record is timed on its own (from the previous reply, or the send), so a chunk never
blurs which record hung. Outcomes without a score, with their reason, counted in :meth:`RewardPool.stats`
(each attempt); whether a reason is a real 0 or a failure (retried, then ``RewardResult.failed``, never
training signal) is declared in ``grpo_verifiers.rewards.failures``:

==================  ======================================================================================
``timeout``         no reply within ``timeout_s``: the worker is SIGKILLed and replaced
``crash: signal N`` the worker died (segfault, abort, OOM kill; ``crash: exit N`` for an exit): replaced
``memory``          ``MemoryError`` inside the reward (the worker's ``RLIMIT_AS`` is ``memory_mb``)
``exception: T: m`` the reward raised ``T(m)``
``non_finite``      NaN/inf; ``out_of_range``: outside [0, 1]; ``bad_result: T``: not a number
``invalid_utf8``    completion/prompt bytes that are not UTF-8, or a str with lone surrogates (never sent)
``empty``           no non-whitespace character; ``oversized``: over ``max_completion_chars`` (never sent)
``unknown_task``    no reward configured for the record's task
==================  ======================================================================================

The records of the chunk behind a hung or crashed one are re-sent to a live worker; a replacement starts in the
background (spawn: ~0.1 s plus imports and warm-up, about 1 s with math-verify) and takes work once it reports
ready, so throughput comes back without the batch waiting for it. Workers start with the ``spawn`` (or
``forkserver``) method, never ``fork``: forking the threaded verifier (Kafka client threads) can copy held locks.

Inline-trusted built-ins (``exact``, ``format``) run in the calling process: they are linear scans of a string
already capped by ``max_completion_chars``, and a pooled call costs an IPC round trip that dwarfs them. Measured
for ``exact`` on a 2-core machine, 2 workers: inline 9-16 us/record; pooled 35-50 us/record for batches of 64+
with chunks of 16, 100-210 us/record with ``max_chunk: 1``, ~110 us for a one-record batch. ``regex`` is never inline:
a pattern can backtrack catastrophically, and only a killable worker bounds that.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

from grpo_core.config import ConfigError, validate_tree
from grpo_verifiers.rewards import failures
from grpo_verifiers.rewards.config import RewardConfig
from grpo_verifiers.rewards.registry import MAX_ERROR_CHARS, Plan, PlannedTerm, TermOutcome, call_term, exception_reason

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 20  # a chunk is read by an idle worker at once; keep one message modest
VM_HEADROOM_MIB = 32  # a worker whose imports already fill memory_mb up to this margin is refused at start
MAX_START_FAILURES = 3  # consecutive failed starts before the pool stops retrying within a batch


@dataclass(slots=True)
class RewardRequest:
    """One completion to score. ``completion``/``prompt`` may arrive as bytes: they must then be UTF-8."""

    completion: str | bytes
    prompt: str | bytes = ""
    task: str = "default"
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RewardResult:
    """The combined reward in [0, 1]; ``error`` is the first failing term's reason (then that term scored 0).

    ``info``: ``{"terms": {label: reward}}``, plus ``"details"`` (each term's own info) and ``"errors"``
    (label -> reason) when present. ``seconds``: compute time of the reward calls (the timeout for a timeout).
    """

    reward: float
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    failed: bool = False  # no score: ``reward`` is a placeholder, never training signal (rewards.failures)


# ------------------------------------------------------------------------------------------ input checks


def _text(value: Any) -> tuple[str | None, str | None]:
    """(text, None) for valid UTF-8 text, (None, reason) otherwise; cheap for the common ASCII case."""
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8"), None
        except UnicodeDecodeError:
            return None, "invalid_utf8"
    if not isinstance(value, str):
        return None, f"bad_input: {type(value).__name__}"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None, "invalid_utf8"
    return value, None


def check_request(req: RewardRequest, max_chars: int) -> tuple[tuple[str, str] | None, str | None]:
    """((completion, prompt), None) when the request may be scored, else (None, reason)."""
    if isinstance(req.completion, str | bytes | bytearray) and len(req.completion) > max_chars:
        return None, "oversized"
    completion, reason = _text(req.completion)
    if completion is None:
        return None, reason
    if not completion or completion.isspace():
        return None, "empty"
    prompt, reason = _text(req.prompt)
    if prompt is None:
        return None, reason
    if not isinstance(req.task, str) or not isinstance(req.metadata, dict):
        return None, "bad_input: task must be a str and metadata a dict"
    return (completion, prompt), None


# ------------------------------------------------------------------------------------------ the worker side


def _vm_mib() -> float:
    """This process's address-space size (what RLIMIT_AS counts), in MiB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker_start(conn: Connection, cfg: RewardConfig) -> Plan | None:
    """Import and warm up the rewards, then cap memory; report ready or why not (None: do not serve)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the verifier's to handle; it closes the pool
    try:
        plan = Plan(cfg)
        for hook in plan.warmups():
            hook()
        vm = _vm_mib()
        if vm + VM_HEADROOM_MIB > cfg.memory_mb:
            conn.send(("failed", f"rewards.memory_mb={cfg.memory_mb} leaves no room: a worker already maps "
                                 f"{vm:.0f} MiB after importing its rewards; raise it to at least "
                                 f"{math.ceil(vm) + 256}"))
            return None
        limit = cfg.memory_mb * 2**20
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if hard != resource.RLIM_INFINITY:  # a container may already cap it lower; never try to raise it
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard if hard != resource.RLIM_INFINITY else limit))
    except Exception as exc:
        conn.send(("failed", exception_reason(exc)))
        return None
    conn.send(("ready", os.getpid(), vm))
    return plan


def _worker_main(conn: Connection, cfg: RewardConfig) -> None:
    """A worker's life: serve chunks of pickled records, one ``("done", outcomes, seconds)`` reply each."""
    plan = _worker_start(conn, cfg)
    if plan is None:
        return
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return  # the verifier is gone
        if chunk is None:
            return
        for payload in chunk:
            t0 = time.perf_counter()
            outcomes = _serve_one(plan, payload)
            try:
                conn.send(("done", outcomes, time.perf_counter() - t0))
            except MemoryError:
                conn.send(("done", [(0.0, "memory", {})], time.perf_counter() - t0))


def _serve_one(plan: Plan, payload: bytes) -> list[tuple[float, str | None, dict[str, Any]]]:
    """The pooled outcomes of one record as plain tuples; a failure outside the terms applies to all of them."""
    try:
        task, completion, prompt, metadata = pickle.loads(payload)
        return [(o.reward, o.error, o.info) for o in plan.run_pooled(task, completion, prompt, metadata)]
    except MemoryError:
        return [(0.0, "memory", {})]
    except Exception as exc:
        return [(0.0, exception_reason(exc), {})]


# ------------------------------------------------------------------------------------------ the verifier side


@dataclass(slots=True, eq=False)
class _Job:
    """A record on its way through the pool: the inline outcomes are in, the pooled ones pending."""

    index: int
    payload: bytes
    terms: list[PlannedTerm]
    outcomes: list[TermOutcome | None]
    seconds: float = 0.0


@dataclass(slots=True, eq=False)
class _Worker:
    """One worker process and the records it has been sent but not yet answered (in order)."""

    proc: BaseProcess
    conn: Connection
    born: float
    ready: bool = False
    jobs: collections.deque[_Job] = field(default_factory=collections.deque)
    head_since: float = 0.0  # when the oldest unanswered record started (its timeout runs from here)


def _crash_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "crash: unknown"
    return f"crash: signal {-exitcode}" if exitcode < 0 else f"crash: exit {exitcode}"


def _combine(job: _Job) -> RewardResult:
    """Weighted average of the terms (weights already normalised); errored terms count as 0, and one whose
    failure policy is ``fail`` makes the whole record failed (a partial sum is no score either)."""
    reward, error, rewards, details, errors, failed = 0.0, None, {}, {}, {}, False
    for term, out in zip(job.terms, job.outcomes, strict=True):
        assert out is not None
        reward += term.weight * out.reward
        rewards[term.label] = out.reward
        if out.info:
            details[term.label] = out.info
        if out.error:
            errors[term.label] = out.error
            error = error or out.error
            failed = failed or failures.policy(out.error, term.zero_on) == "fail"
    info: dict[str, Any] = {"terms": rewards}
    if details:
        info["details"] = details
    if errors:
        info["errors"] = errors
    return RewardResult(0.0 if failed else min(1.0, max(0.0, reward)), error, info, job.seconds, failed)


class RewardPool:
    """Scores batches of :class:`RewardRequest` with the configured rewards, inline or in sandbox workers.

    One caller at a time (a lock serialises :meth:`score_batch`); the verifier's scoring loop owns it. Start-up
    blocks until every worker is ready and raises :class:`ConfigError` when one cannot start (a reward module
    that does not import in a fresh process, ``memory_mb`` below the workers' baseline).
    """

    def __init__(self, cfg: RewardConfig) -> None:
        validate_tree(cfg)
        self.cfg = cfg
        self._plan = Plan(cfg)
        self._ctx = cast("SpawnContext | ForkServerContext", multiprocessing.get_context(cfg.start_method))
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False
        self._start_failures = 0
        self._last_start_error = ""
        self._counts: collections.Counter[str] = collections.Counter()
        self._errors: collections.Counter[str] = collections.Counter()
        try:
            self._refill(initial=True)
            if not self._wait_ready(cfg.start_timeout_s):
                raise ConfigError(f"reward workers did not start: {self._last_start_error or 'start timeout'}")
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------------------------------- public API

    def score_batch(self, items: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order. Never raises for anything a request or a reward does.

        A failed record (policy ``fail``, see ``rewards.failures``) is scored again up to ``retries`` times: a
        crashed or hung worker is replaced, so a second try usually gives the score."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            results = self._score(items)
            for _ in range(self.cfg.retries):
                again = [i for i, r in enumerate(results) if r.failed and failures.retriable(r.error or "")]
                if not again:
                    break
                self._counts["retried"] += len(again)
                for i, result in zip(again, self._score([items[i] for i in again]), strict=True):
                    results[i] = result
            self._counts["failed"] += sum(r.failed for r in results)
            return results

    def _score(self, items: Sequence[RewardRequest]) -> list[RewardResult]:
        """One pass over ``items`` (no retries): inline terms here, pooled ones in the workers."""
        results: list[RewardResult | None] = [None] * len(items)
        jobs: list[_Job] = []
        for i, req in enumerate(items):
            prepared = self._prepare(i, req)
            if isinstance(prepared, RewardResult):
                results[i] = prepared
            else:
                jobs.append(prepared)
        queue = collections.deque(j for j in jobs if j.payload)
        if queue:
            self._counts["pooled_records"] += len(queue)
            try:
                self._drive(queue)
            except Exception as exc:  # a pool bug or an OS limit (fds, processes): lose a batch, not the service
                log.exception("reward pool failed; restarting its workers")
                for job in jobs:
                    self._fail_job(job, f"pool_error: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
                self._reset_workers()
        for job in jobs:
            results[job.index] = self._finish(job)
        return results  # type: ignore[return-value]

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until all ``workers`` are ready (e.g. after a crash, for a health check); False on timeout."""
        with self._lock:
            return self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        self._start_failures = 0
        while True:
            self._refill()
            pending = [w for w in self._workers if not w.ready]
            if len(self._workers) == self.cfg.workers and not pending:
                return True
            left = end - time.monotonic()
            if left <= 0 or self._start_failures >= MAX_START_FAILURES:
                return False
            ready = wait([w.conn for w in pending] + [w.proc.sentinel for w in pending], min(left, 0.5))
            for w in pending:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._service(w, collections.deque())

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: records, errors by reason kind, restarts, live/ready workers."""
        with self._lock:
            for w in list(self._workers):  # pick up "ready" messages of replacements between batches
                if not w.ready and (w.conn.poll() or not w.proc.is_alive()):
                    self._service(w, collections.deque())
            return {
                "calls": self._counts["calls"], "pooled_records": self._counts["pooled_records"],
                "inline_terms": self._counts["inline_terms"], "errors": dict(self._errors),
                "worker_restarts": self._counts["worker_restarts"], "restarts": self._counts["worker_restarts"],
                "retried": self._counts["retried"], "failed": self._counts["failed"],
                "workers_alive": sum(w.proc.is_alive() for w in self._workers),
                "workers_ready": sum(w.ready for w in self._workers),
            }

    def close(self) -> None:
        """Stop the workers: a polite ``None``, then SIGKILL for any still running after 2 s. Idempotent."""
        self._closed = True
        workers, self._workers = self._workers, []
        for w in workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)
        end = time.monotonic() + 2.0
        for w in workers:
            w.proc.join(max(0.0, end - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1.0)
            w.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- records

    def _prepare(self, index: int, req: RewardRequest) -> RewardResult | _Job:
        """Validate a request and run its inline terms; a job with a payload still needs a worker."""
        self._counts["calls"] += 1
        texts, reason = check_request(req, self.cfg.max_completion_chars)
        if texts is None:
            return self._rejected(reason or "bad_input")
        terms = self._plan.terms(req.task)
        if terms is None:
            return self._rejected(f"unknown_task: {req.task}"[:MAX_ERROR_CHARS])
        completion, prompt = texts
        t0 = time.perf_counter()
        outcomes: list[TermOutcome | None] = [
            call_term(t.fn, t.params, completion, prompt, req.metadata) if t.inline else None for t in terms]
        job = _Job(index, b"", terms, outcomes, time.perf_counter() - t0)
        self._counts["inline_terms"] += sum(t.inline for t in terms)
        if any(o is None for o in outcomes):
            try:
                job.payload = pickle.dumps((req.task, completion, prompt, req.metadata), pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                self._fail_job(job, f"bad_input: metadata cannot be pickled: {exception_reason(exc)}")
        return job

    def _rejected(self, reason: str) -> RewardResult:
        self._errors[failures.kind(reason)] += 1
        return RewardResult(0.0, reason, {}, 0.0, failures.policy(reason) == "fail")

    def _finish(self, job: _Job) -> RewardResult:
        for out in job.outcomes:
            if out is not None and out.error:
                self._errors[failures.kind(out.error)] += 1
        return _combine(job)

    @staticmethod
    def _fail_job(job: _Job, reason: str, seconds: float = 0.0) -> None:
        """Every still-pending term of ``job`` scores 0 with ``reason``."""
        job.outcomes = [TermOutcome(0.0, reason) if o is None else o for o in job.outcomes]
        job.seconds += seconds

    @staticmethod
    def _settle(job: _Job, replies: list[tuple[float, str | None, dict[str, Any]]], seconds: float) -> None:
        """Fill a job's pooled outcomes from a worker reply (one failure for all when the worker sent one)."""
        pending = [k for k, o in enumerate(job.outcomes) if o is None]
        outs = [TermOutcome(r, e, i) for r, e, i in replies]
        if len(outs) != len(pending):
            outs = [outs[0] if outs and outs[0].error else TermOutcome(0.0, "bad_reply")] * len(pending)
        for k, out in zip(pending, outs, strict=True):
            job.outcomes[k] = out
        job.seconds += seconds

    # -------------------------------------------------------------------------------------- scheduling

    def _drive(self, queue: collections.deque[_Job]) -> None:
        """Run the queued jobs to completion across the workers, replacing any that hang or die."""
        self._start_failures = 0  # a new batch may retry starts that gave up during the last one
        self._refill()
        while queue or any(w.jobs for w in self._workers):
            self._dispatch(queue)
            if queue and not self._workers:
                reason = f"pool_unavailable: {self._last_start_error}"[:MAX_ERROR_CHARS]
                for job in queue:
                    self._fail_job(job, reason)
                queue.clear()
                return
            now = time.monotonic()
            deadlines = [w.head_since + self.cfg.timeout_s for w in self._workers if w.jobs]
            deadlines += [w.born + self.cfg.start_timeout_s for w in self._workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else 0.5
            objects = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            ready = set(wait(objects, timeout))
            for w in list(self._workers):
                if w.conn in ready or w.proc.sentinel in ready:
                    self._service(w, queue)
            self._enforce_deadlines(queue)

    def _dispatch(self, queue: collections.deque[_Job]) -> None:
        """Send each idle ready worker a chunk: about a half share of the queue, capped by count and bytes."""
        ready = [w for w in self._workers if w.ready]
        for w in [w for w in ready if not w.jobs]:
            if not queue:
                return
            n = max(1, min(self.cfg.max_chunk, math.ceil(len(queue) / (2 * len(ready)))))
            chunk: list[_Job]
            chunk, size = [], 0
            while queue and len(chunk) < n and (not chunk or size + len(queue[0].payload) <= MAX_CHUNK_BYTES):
                chunk.append(queue.popleft())
                size += len(chunk[-1].payload)
            try:
                w.conn.send([job.payload for job in chunk])
            except (OSError, ValueError):
                queue.extendleft(reversed(chunk))
                self._on_death(w, queue)
                continue
            w.jobs.extend(chunk)
            w.head_since = time.monotonic()

    def _service(self, w: _Worker, queue: collections.deque[_Job]) -> None:
        """Read every pending message of ``w``; a closed pipe or a dead process means it died."""
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        else:
            if w.proc.is_alive():
                return
        self._on_death(w, queue)

    def _on_message(self, w: _Worker, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            self._start_failures = 0
        elif kind == "failed":  # reported by the worker itself: deterministic (imports, memory floor), no retry
            self._last_start_error = str(msg[1])
            self._start_failures = MAX_START_FAILURES
        elif kind == "done" and w.jobs:
            self._settle(w.jobs.popleft(), msg[1], msg[2])
            w.head_since = time.monotonic()

    def _enforce_deadlines(self, queue: collections.deque[_Job]) -> None:
        """Kill a worker whose oldest record ran past ``timeout_s`` (or that never became ready)."""
        now = time.monotonic()
        for w in list(self._workers):
            if w.jobs and now - w.head_since >= self.cfg.timeout_s:
                if w.conn.poll():  # a reply that raced the deadline still counts
                    self._service(w, queue)
                    continue
                log.warning("reward worker %s: a record ran past timeout_s=%s; killed, replacing it",
                            w.proc.pid, self.cfg.timeout_s)
                self._remove(w)
                self._fail_job(w.jobs.popleft(), "timeout", self.cfg.timeout_s)
                queue.extendleft(reversed(w.jobs))
                self._refill()
            elif not w.ready and now - w.born >= self.cfg.start_timeout_s:
                self._last_start_error = f"not ready within start_timeout_s={self.cfg.start_timeout_s}"
                self._start_failures += 1
                self._remove(w)
                self._refill()

    def _on_death(self, w: _Worker, queue: collections.deque[_Job]) -> None:
        """A worker exited: blame the record it was running, re-queue the rest of its chunk, replace it."""
        self._remove(w, grace_s=2.0)  # its pipe closed: it is exiting (an exit status beats our SIGKILL's)
        log.warning("reward worker %s died (%s)%s; replacing it", w.proc.pid, _crash_reason(w.proc.exitcode),
                    "" if w.ready else f" while starting: {self._last_start_error}")
        if not w.ready:
            self._start_failures += 1
            self._last_start_error = self._last_start_error or _crash_reason(w.proc.exitcode)
        if w.jobs:
            self._fail_job(w.jobs.popleft(), _crash_reason(w.proc.exitcode))
            queue.extendleft(reversed(w.jobs))
        self._refill()

    # -------------------------------------------------------------------------------------- processes

    def _reset_workers(self) -> None:
        """Replace every worker (after an unexpected pool error their state is unknown)."""
        for w in list(self._workers):
            self._remove(w)
        with contextlib.suppress(Exception):
            self._refill()

    def _remove(self, w: _Worker, grace_s: float = 0.0) -> None:
        """Take ``w`` out of the pool, making sure its process is gone (SIGKILL after ``grace_s``)."""
        if w in self._workers:
            self._workers.remove(w)
        w.proc.join(grace_s)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(5.0)
        w.conn.close()

    def _refill(self, initial: bool = False) -> None:
        """Start workers up to ``cfg.workers`` (not after MAX_START_FAILURES consecutive failed starts)."""
        while (len(self._workers) < self.cfg.workers and not self._closed
               and self._start_failures < MAX_START_FAILURES):
            parent, child = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=_worker_main, args=(child, self.cfg), daemon=True,
                                     name="reward-worker")
            proc.start()
            child.close()
            self._workers.append(_Worker(proc, parent, time.monotonic()))
            if not initial:
                self._counts["worker_restarts"] += 1
