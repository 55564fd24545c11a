"""Reward functions written for TRL's ``GRPOTrainer`` (``reward_funcs``), used as they are: ``trl:module:function``.

TRL's convention: ``fn(prompts, completions, **columns) -> list[float | None]``, batched, one value per sample,
where ``columns`` are the dataset's other columns as lists (one entry per sample) and ``None`` means "this
function does not apply to this sample" (TRL sums the weighted rewards with ``nansum``, so the term adds
nothing). In a conversational dataset ``prompts`` are message lists and each completion is
``[{"role": "assistant", "content": text}]``.

Here a term ``{name: "trl:my_pkg.rewards:accuracy"}`` is called once per completion with lists of one: the
record's prompt, its completion and every PromptTask metadata field as a one-element column. Why not the group's
G at once: TRL itself calls them on each process's slice of the generation batch, which holds whole groups or
parts of groups depending on the device count, so a TRL reward function cannot depend on which samples share
its call -- it scores each sample on its own (a ``zip`` over the lists), and one at a time gives TRL's value
while keeping the pool's per-record timeout and retry (one hung sample costs one record, not its group).
``None`` scores 0 without an error (``info: {"trl": "none"}``), as TRL's ``nansum`` leaves it out. The value
is judged like any reward's (``grpo_verifiers.rewards.registry.judge``: in [0, 1], finite). The term's
``params`` are passed as keyword arguments, except ``conversational`` (default false), which is this adapter's:
wrap the prompt as a user message and the completion as an assistant message, for functions written for a chat
dataset (the producers' ``apply_chat_template``). It runs in the sandboxed pool like any user function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]

PREFIX = "trl:"
ADAPTER_PARAMS = frozenset({"conversational"})


def as_reward(fn: RewardFn) -> RewardFn:
    """``fn`` (TRL convention) as a per-completion reward ``(completion, prompt, metadata, **params)``."""

    @functools.wraps(fn)
    def reward(completion: str, prompt: str, metadata: dict[str, Any], conversational: bool = False,
               **params: Any) -> Any:
        columns = {k: [v] for k, v in metadata.items() if k not in ("prompts", "completions")}
        if conversational:
            prompts: list[Any] = [[{"role": "user", "content": prompt}]]
            completions: list[Any] = [[{"role": "assistant", "content": completion}]]
        else:
            prompts, completions = [prompt], [completion]
        out = fn(prompts=prompts, completions=completions, **columns, **params)
        if not isinstance(out, list | tuple) or len(out) != 1:
            raise ValueError(f"a TRL reward function returns one value per completion: got "
                             f"{type(out).__name__} of length {len(out) if hasattr(out, '__len__') else '?'} for 1")
        return (0.0, {"trl": "none"}) if out[0] is None else out[0]

    reward.trl_function = fn  # type: ignore[attr-defined]
    return reward


def check(fn: RewardFn, params: dict[str, Any]) -> None:
    """Raise TypeError now when ``fn`` cannot take ``prompts=``, ``completions=`` and the term's params (the
    columns it requires come from each record's metadata: a record without one fails on its own)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    passed = {k: v for k, v in params.items() if k not in ADAPTER_PARAMS}
    signature.bind_partial(prompts=[], completions=[], **passed)
