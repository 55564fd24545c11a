"""One guarded reward call, the judging of its value, and the per-task plan shared by the pool and its workers.

Everything here runs on both sides of the sandbox: the verifier process uses it for the inline-trusted terms,
each worker for the rest. :func:`call_term` is the single place where a reward's return value is judged, so
"what counts as a valid reward" cannot differ between inline and pooled execution.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_verifiers.rewards.builtins import BUILTINS, RewardFn, resolve
from grpo_verifiers.rewards.config import RewardConfig, RewardTerm
from grpo_verifiers.rewards.failures import BadInput

MAX_INFO_CHARS = 4096  # a term's info travels in every ScoredGroup: keep it a summary, not a transcript
MAX_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class TermOutcome:
    """One term's result: reward in [0, 1], an error reason (then reward 0) and JSON-able info."""

    reward: float
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def exception_reason(exc: BaseException) -> str:
    """``exception: ValueError: message`` (message cut short: it lands in metrics labels' neighbours and logs)."""
    return f"exception: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def _safe_info(info: Any) -> dict[str, Any]:
    """The info dict if it is a small JSON-able mapping, else a note saying why it was dropped."""
    if not isinstance(info, dict):
        return {"info_dropped": f"not a dict: {type(info).__name__}"}
    try:
        text = json.dumps(info, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return {"info_dropped": f"not JSON-able: {type(exc).__name__}"}
    return info if len(text) <= MAX_INFO_CHARS else {"info_dropped": f"{len(text)} chars > {MAX_INFO_CHARS}"}


def judge(out: Any) -> TermOutcome:
    """Turn a reward function's return value into an outcome: non-finite, out-of-range or odd values score 0."""
    info: Any = {}
    if isinstance(out, tuple) and len(out) == 2:
        out, info = out
    if isinstance(out, bool):
        out = float(out)
    if not isinstance(out, int | float):
        return TermOutcome(0.0, f"bad_result: {type(out).__name__}")
    value = float(out)
    if not math.isfinite(value):
        return TermOutcome(0.0, "non_finite")
    if not 0.0 <= value <= 1.0:
        return TermOutcome(0.0, "out_of_range", {"value": value})
    return TermOutcome(value, None, _safe_info(info) if info else {})


def call_term(fn: RewardFn, params: dict[str, Any], completion: str, prompt: str,
              metadata: dict[str, Any]) -> TermOutcome:
    """Call one reward, never raising: an exception or MemoryError becomes a reason, the value is judged."""
    try:
        out = fn(completion, prompt, metadata, **params)
    except MemoryError:
        return TermOutcome(0.0, "memory")
    except BadInput as exc:  # the record's metadata, not the reward, is at fault (rewards.failures)
        return TermOutcome(0.0, f"bad_input: {exc}"[:MAX_ERROR_CHARS])
    except Exception as exc:  # any bug in a reward is one record's zero, never the service's crash
        return TermOutcome(0.0, exception_reason(exc))
    return judge(out)


@dataclass(frozen=True, slots=True)
class PlannedTerm:
    """A resolved term: its function, normalised weight, params, a unique label and where it runs."""

    label: str
    fn: RewardFn
    weight: float
    params: dict[str, Any]
    inline: bool
    zero_on: frozenset[str] = frozenset()  # failure kinds the term declares the completion's fault (failures.py)


class Plan:
    """Per-task resolved terms, computed once per task name (both in the verifier and in every worker)."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._inline = frozenset(cfg.inline_trusted)
        self._cache: dict[str, list[PlannedTerm] | None] = {}
        for terms in cfg.by_task.values():  # resolve (import) every configured function up front
            self._plan(terms)

    def terms(self, task: str) -> list[PlannedTerm] | None:
        """The planned terms of ``task``, None for a task no config entry covers."""
        if task not in self._cache:
            if len(self._cache) > 10_000:  # task names come from records: bound the cache against garbage
                self._cache.clear()
            terms = self.cfg.terms_for(task)
            self._cache[task] = None if terms is None else self._plan(terms)
        return self._cache[task]

    def _plan(self, terms: list[RewardTerm]) -> list[PlannedTerm]:
        total = sum(t.weight for t in terms) or 1.0
        labels: dict[str, int] = {}
        planned = []
        for t in terms:
            n = labels[t.name] = labels.get(t.name, 0) + 1
            label = t.name if n == 1 else f"{t.name}#{n}"
            planned.append(PlannedTerm(label, resolve(t.name), t.weight / total, dict(t.params),
                                       t.name in self._inline, frozenset(t.zero_on)))
        return planned

    def warmups(self) -> list[Callable[[], None]]:
        """Warm-up hooks of the pooled built-ins this config can use (run by a worker before it reports ready)."""
        names = {t.name for terms in self.cfg.by_task.values() for t in terms}
        names |= {n for n, b in BUILTINS.items() if b.warm_always}
        hooks = [BUILTINS[n].warmup for n in sorted(names) if n in BUILTINS and n not in self._inline]
        return [h for h in hooks if h is not None]

    def score_here(self, task: str, completion: str, prompt: str, metadata: dict[str, Any]) -> float:
        """The weighted reward of ``task``'s terms, every one called in this process, no sandbox: for tools and
        benchmarks scoring with trusted rewards (a term that fails scores 0; a task no term covers, 0)."""
        return sum(t.weight * call_term(t.fn, t.params, completion, prompt, metadata).reward
                   for t in self.terms(task) or ())

    def run_pooled(self, task: str, completion: str, prompt: str, metadata: dict[str, Any]) -> list[TermOutcome]:
        """The outcomes of ``task``'s pooled terms, in plan order (what a worker computes for one record)."""
        return [call_term(t.fn, t.params, completion, prompt, metadata) for t in self.terms(task) or () if not t.inline]
