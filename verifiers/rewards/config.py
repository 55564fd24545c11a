"""Typed config of the rewards library: which reward terms score which task, and the sandbox pool's limits.

YAML shape (the ``rewards:`` section of the verifier config)::

    rewards:
      workers: 2
      timeout_s: 5
      by_task:
        math:    [{name: math, weight: 0.9}, {name: format, weight: 0.1, params: {tags: [think, answer]}}]
        default: [{name: exact}]

Task selection (:meth:`RewardConfig.terms_for`): ``by_task[task]``, else -- when the task is itself the name of a
built-in reward (the datasets' convention: ``task: math``, the synthetic tasks' ``exact``) -- that reward alone,
else ``by_task["default"]``, else nothing (the record is scored 0 with error ``unknown_task``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

from grpo_core.config import ConfigError, opt, require
from grpo_verifiers.rewards import trl_style
from grpo_verifiers.rewards.builtins import BUILTINS, resolve
from grpo_verifiers.rewards.failures import ZEROABLE

StartMethod = Literal["spawn", "forkserver"]
DEFAULT_TASK = "default"


@dataclass
class RewardTerm:
    """One weighted reward of a task's combination (weights are normalised to sum to 1)."""

    name: str = opt(help="A built-in (exact, positions, regex, format, overlong, math, reasoning_gym), a dotted path "
                         "'package.module:function', or 'trl:package.module:function' for a reward function "
                         "written for TRL's GRPOTrainer (grpo_verifiers.rewards.trl_style).")
    weight: float = opt(1.0, "Relative weight; a task's weights are divided by their sum.")
    params: dict[str, Any] = opt(factory=dict, help="Keyword arguments passed to the reward function.")
    zero_on: list[str] = opt(
        factory=list, help="Failure kinds of this term that are the completion's fault and score 0 instead of "
        "failing (e.g. [timeout] for a checker a pathological expression can hang); allowed: "
        f"{sorted(ZEROABLE)}. See grpo_verifiers.rewards.failures.")

    def validate(self) -> None:
        require(bool(self.name), "rewards.by_task.*.name: must not be empty")
        require(self.weight >= 0, f"reward term {self.name}: weight must be >= 0, got {self.weight}")
        bad = sorted(set(self.zero_on) - ZEROABLE)
        require(not bad, f"reward term {self.name}: zero_on {bad} not allowed; allowed: {sorted(ZEROABLE)}")


@dataclass
class RewardConfig:
    """The rewards library and its sandbox (``grpo_verifiers.rewards.RewardPool``)."""

    by_task: dict[str, list[RewardTerm]] = opt(
        factory=dict, help="Task name -> weighted reward terms; key 'default' serves unmapped tasks. A task named "
        "like a built-in reward (math, exact, ...) uses that reward when it has no entry.")
    workers: int = opt(2, "Sandbox worker processes scoring in parallel (each is restarted when it hangs or dies).")
    timeout_s: float = opt(5.0, "Per-record limit for the pooled terms; past it the worker is killed and the record "
                           "retried, then marked failed (or 0 where the term says zero_on: [timeout]).")
    retries: int = opt(1, "Extra tries for a record whose reward failed (crash, timeout, exception, ...) before it "
                       "is published as failed: never a training signal (grpo_verifiers.rewards.failures).")
    memory_mb: int = opt(1024, "Address-space cap (RLIMIT_AS) of each worker, in MiB, set after its imports.")
    max_completion_chars: int = opt(100_000, "Longer completions score 0 ('oversized') without any reward call.")
    inline_trusted: list[str] = opt(
        factory=lambda: ["exact", "positions", "format", "overlong"], help="Built-ins run in the verifier process "
        "itself (no IPC): only the inline-safe ones (exact, positions, format, overlong) are allowed; regex stays "
        "pooled (catastrophic backtracking).")
    start_method: StartMethod = opt("spawn", "multiprocessing start method of the workers (never fork: the "
                                    "verifier has Kafka client threads).")
    max_chunk: int = opt(16, "Most records sent to a worker in one message (each is still timed on its own).")
    start_timeout_s: float = opt(60.0, "How long a starting worker may take to import and warm up its rewards.")

    def validate(self) -> None:
        require(1 <= self.workers <= 256, "rewards.workers: must be in [1, 256]")
        require(self.timeout_s > 0, "rewards.timeout_s: must be > 0")
        require(0 <= self.retries <= 5, "rewards.retries: must be in [0, 5]")
        require(self.memory_mb >= 64, "rewards.memory_mb: must be >= 64 (a Python worker alone needs ~30 MiB)")
        require(self.max_completion_chars >= 1, "rewards.max_completion_chars: must be >= 1")
        require(1 <= self.max_chunk <= 1024, "rewards.max_chunk: must be in [1, 1024]")
        require(self.start_timeout_s > 0, "rewards.start_timeout_s: must be > 0")
        for name in self.inline_trusted:
            entry = BUILTINS.get(name)
            safe = sorted(n for n, b in BUILTINS.items() if b.inline_safe)
            require(entry is not None and entry.inline_safe,
                    f"rewards.inline_trusted: {name!r} may not run inline; allowed: {safe}")
        for task, terms in self.by_task.items():
            require(bool(terms), f"rewards.by_task.{task}: needs at least one term")
            require(sum(t.weight for t in terms) > 0, f"rewards.by_task.{task}: weights must not all be 0")
            for i, term in enumerate(terms):
                term.validate()
                check_term(term, f"rewards.by_task.{task}[{i}]")

    def terms_for(self, task: str) -> list[RewardTerm] | None:
        """The terms scoring ``task`` (see the module docstring for the lookup order), None when none apply."""
        if task in self.by_task:
            return self.by_task[task]
        if task in BUILTINS:
            return [RewardTerm(task)]
        return self.by_task.get(DEFAULT_TASK)


def check_term(term: RewardTerm, where: str) -> None:
    """Resolve the term's function and check its params now, so a typo fails at config load, not per record."""
    try:
        fn = resolve(term.name)
    except Exception as exc:  # whatever importing a user module raises, it is this key's problem
        raise ConfigError(f"{where}.name: {type(exc).__name__}: {exc}") from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none: nothing to check
        return
    try:
        if term.name in BUILTINS:
            BUILTINS[term.name].check(**term.params)
        elif hasattr(fn, "trl_function"):
            trl_style.check(fn.trl_function, term.params)
        else:
            signature.bind("", "", {}, **term.params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.params: {exc}") from None
