"""The ``reasoning_gym`` reward: the generating dataset's own ``score_answer(answer, entry)`` (PyPI ``reasoning-gym``).

Where from: the feeder's ``reasoning_gym`` source (``grpo_producers.reasoning_gym_source``) puts into every
PromptTask's metadata the sub-dataset that generated the prompt (``rg_dataset``), that dataset's configured options
as JSON (``rg_config``) and the whole entry as JSON (``rg_entry``); the producers copy the metadata into each
completion. This reward rebuilds the dataset from name and options -- once per worker and configuration; a few
``score_answer`` read ``self.config``, e.g. ``decimal_arithmetic``'s tolerance -- and returns
``score_answer(extracted, entry)``: reasoning-gym's own verdict, partial credit included (``spell_backward``
gives some for a prefix, the default scorer ``len(oracle) / len(answer)`` for an answer that contains it).

Extraction, as reasoning-gym's ``extract_answer``: the text of the *last* ``<answer>...</answer>`` pair (a model
that corrects itself answers twice), stripped; ``tag`` names another pair, ``pattern`` replaces the tags with a
regex (its first group, else the whole match, of the last match). No answer found scores 0 without calling
``score_answer``, as reasoning-gym scores ``None``.

Failures follow ``grpo_verifiers.rewards.failures``: metadata without a usable entry (a prompt that did not come
from the reasoning_gym source, a truncated entry, an unknown dataset) raises :class:`failures.BadInput` --
``bad_input``, failed and not retried: the dataset is at fault, not the completion. An exception inside
``score_answer`` is ``exception`` (failed, retried once); a term that trusts the completion to be the cause can say
``zero_on: [exception]``. ``reasoning_gym`` is imported in the pooled workers, never in the verifier process: before
a worker reports ready (``warmup``, about 2 s) where a ``by_task`` term names this reward, else on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from typing import Any

from grpo_verifiers.rewards.failures import BadInput

PACKAGE_HINT = "pip install 'grpo-stream[reasoning-gym]' (or reasoning-gym==0.1.25)"
_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")
_INFO_CHARS = 64


def extract(text: str, tag: str = "answer", pattern: str | None = None) -> str | None:
    """The answer in ``text``: the last ``<tag>...</tag>`` (or last ``pattern`` match), stripped; None if none."""
    regex = re.compile(pattern, re.DOTALL) if pattern else re.compile(f"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>",
                                                                      re.DOTALL)
    matches = list(regex.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if regex.groups else last.group(0)).strip()


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options: str) -> Any:
    """The dataset object whose score_answer scores ``name``'s entries (options: the configured JSON)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS or name == "composite":
        raise BadInput(f"rg_dataset {name!r} is not a reasoning-gym dataset (of this reasoning-gym version)")
    try:
        config = json.loads(options)
        if not isinstance(config, dict):
            raise ValueError("not an object")
        return reasoning_gym.create_dataset(name, **config)
    except (ValueError, TypeError, AssertionError) as exc:
        raise BadInput(f"rg_config of {name} does not build the dataset: {type(exc).__name__}: {exc}") from None


def _entry(metadata: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(dataset name, options JSON, entry) from a record's metadata, or BadInput saying what is wrong."""
    name, options, text = metadata.get("rg_dataset"), metadata.get("rg_config", "{}"), metadata.get("rg_entry")
    if not isinstance(name, str) or not isinstance(text, str) or not isinstance(options, str):
        raise BadInput("metadata needs rg_dataset, rg_entry (and rg_config) as strings: is this prompt from the "
                       "feeder's reasoning_gym source?")
    try:
        entry = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"rg_entry is not JSON: {exc}") from None
    if not isinstance(entry, dict) or "answer" not in entry:
        raise BadInput("rg_entry is not a reasoning-gym entry (an object with an answer)")
    return name, options, entry


def score(completion: str, prompt: str, metadata: dict[str, Any], *, tag: str = "answer",
          pattern: str | None = None) -> tuple[float, dict[str, Any]]:
    """``score_answer(extracted answer, entry)`` of the dataset that generated the prompt (module docstring)."""
    from grpo_verifiers.rewards.builtins import cut_special

    del prompt
    name, options, entry = _entry(metadata)
    dataset = _dataset(name, options)
    answer = extract(cut_special(completion), tag, pattern)
    info: dict[str, Any] = {"dataset": name, "extracted": None if answer is None else answer[:_INFO_CHARS]}
    if answer is None:
        return 0.0, info
    return float(dataset.score_answer(answer, entry)), info


def check_params(tag: str = "answer", pattern: str | None = None) -> None:
    """Config-time validation (``grpo_verifiers.rewards.builtins``), including that the package is installed."""
    if not isinstance(tag, str) or _TAG_NAME.fullmatch(tag) is None:
        raise ValueError(f"tag: {tag!r} is not a tag name")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError("pattern: must be a string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"pattern: {pattern!r} does not compile: {exc}") from None
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(f"the reasoning_gym reward needs the reasoning-gym package: {PACKAGE_HINT}")


def warmup() -> None:
    """Import reasoning-gym (every dataset module, ~2 s) before the worker reports ready, not in a timed call."""
    import reasoning_gym  # noqa: F401
