"""The built-in reward functions (``exact``, ``positions``, ``regex``, ``format``, ``math``, ``reasoning_gym``) and
their registry.

Every function follows the contract in :mod:`grpo_verifiers.rewards`: ``fn(completion, prompt, metadata, **params)``
returns a float in [0, 1] or ``(float, info)``. Each registry entry also carries a ``check`` that validates the
params at config-load time (a typo'd mode fails ``validate()`` instead of erroring on every record), whether the
function may run in the verifier's own process (``inline_safe``), and an optional ``warmup`` a worker runs before
it reports ready (so a slow first import does not eat the first call's timeout) -- every worker, or with
``warm_always=False`` only workers whose config names the reward (a heavy optional package).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_verifiers.rewards import math_reward, reasoning_gym_reward, trl_style

RewardFn = Callable[..., Any]

# ------------------------------------------------------------------------------------------ shared helpers

# Text a decoder can leave in a completion when special tokens are not skipped: everything from the first of
# these on is end-of-sequence padding, never part of the answer.
SPECIAL_MARKERS = ("<|", "</s>", "<eos>", "<end_of_turn>")


def cut_special(text: str) -> str:
    """``text`` up to the first special-token marker (``"7<|endoftext|>"`` -> ``"7"``)."""
    cut = len(text)
    for marker in SPECIAL_MARKERS:
        at = text.find(marker, 0, cut)
        if at >= 0:
            cut = at
    return text[:cut]


def answers_of(metadata: dict[str, Any], key: str = "answer") -> list[str]:
    """The acceptable answers: ``metadata[key]`` as text, a list meaning "any of these".

    A missing answer raises (reported as ``exception: ValueError``): scoring it 0 silently would hide a broken
    dataset mapping behind a flat reward curve.
    """
    value = metadata.get(key)
    if value is None:
        raise ValueError(f"metadata has no {key!r}")
    values = value if isinstance(value, list | tuple) else [value]
    return [str(v) for v in values]


# ------------------------------------------------------------------------------------------ exact

ExactMode = Literal["token", "line", "full"]

# How much of the (special-token-cut, stripped) completion is the model's answer.
_EXACT_EXTRACT: dict[str, Callable[[str], str]] = {
    "token": lambda t: t.split(maxsplit=1)[0] if t else "",  # "7\nmore" / "7 because" -> "7"
    "line": lambda t: t.split("\n", 1)[0].strip(),  # "x = 7\nbecause" -> "x = 7"
    "full": lambda t: t,  # the whole completion
}


def exact(completion: str, prompt: str, metadata: dict[str, Any], *, mode: ExactMode = "token",
          case_sensitive: bool = True) -> tuple[float, dict[str, Any]]:
    """1.0 when the completion's answer equals ``metadata["answer"]`` (or one of a list), else 0.0.

    The answer is extracted as: cut at the first special-token marker (``<|endoftext|>``, ``</s>``, ...), strip
    whitespace, then ``mode``: ``token`` (default) the first whitespace-delimited run, ``line`` the first line,
    ``full`` everything. So for the synthetic tasks ``"7"``, ``"7\\n..."``, ``" 7 and"`` and ``"7<|endoftext|>"``
    all match answer ``"7"``; ``"72"`` and ``"7."`` do not (no partial credit, no punctuation guessing).
    """
    del prompt
    got = _EXACT_EXTRACT[mode](cut_special(completion).strip())
    wanted = [a.strip() for a in answers_of(metadata)]
    if not case_sensitive:
        got, wanted = got.casefold(), [a.casefold() for a in wanted]
    return (1.0 if got in wanted else 0.0), {"extracted": got[:64]}


def _check_exact(mode: str = "token", case_sensitive: bool = True) -> None:
    _expect(mode in _EXACT_EXTRACT, f"mode: {mode!r} is not one of {sorted(_EXACT_EXTRACT)}")
    _expect(isinstance(case_sensitive, bool), "case_sensitive: must be true or false")


# ------------------------------------------------------------------------------------------ positions


def positions(completion: str, prompt: str, metadata: dict[str, Any], *,
              case_sensitive: bool = True) -> tuple[float, dict[str, Any]]:
    """Partial credit for a multi-character answer: the characters in their right place, over the longer length.

    The answer is extracted as ``exact``'s ``token`` mode (cut at special tokens, strip, first whitespace run);
    with ``metadata["answer"]`` = ``"3847"``: ``"3847"`` 1.0, ``"3841"`` 0.75, ``"38"`` 0.5, ``"38470"`` 0.8,
    ``""`` 0. A list of answers scores against the best one. A dense signal where exact match is too sparse for
    a small model (the synthetic ``copy`` / ``reverse`` families).
    """
    del prompt
    got = _EXACT_EXTRACT["token"](cut_special(completion).strip())
    best = 0.0
    for wanted in (a.strip() for a in answers_of(metadata)):
        a, b = (got, wanted) if case_sensitive else (got.casefold(), wanted.casefold())
        width = max(len(a), len(b))
        if width:
            best = max(best, sum(x == y for x, y in zip(a, b, strict=False)) / width)
    return best, {"extracted": got[:64]}


def _check_positions(case_sensitive: bool = True) -> None:
    _expect(isinstance(case_sensitive, bool), "case_sensitive: must be true or false")


# ------------------------------------------------------------------------------------------ overlong


def overlong(completion: str, prompt: str, metadata: dict[str, Any], *, max_chars: int,
             buffer_chars: int = 0) -> tuple[float, dict[str, Any]]:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) as a reward in [0, 1], in characters (a reward
    sees text, not tokens): 1 up to ``max_chars - buffer_chars``, then falling linearly to 0 at ``max_chars``, 0
    beyond. DAPO adds it to the task's reward as a penalty in [-1, 0]; here it is a term to weight beside the
    task's (``weight``), e.g. ``[{name: math, weight: 0.9}, {name: overlong, weight: 0.1, params: {...}}]``.
    ``bench throughput`` scores with it alone: a reward that differs within every group of a random model."""
    del prompt, metadata
    n = len(completion)
    if n <= max_chars - buffer_chars:
        return 1.0, {"chars": n}
    return (max(0.0, (max_chars - n) / buffer_chars) if buffer_chars else 0.0), {"chars": n}


def _check_overlong(max_chars: int = 0, buffer_chars: int = 0) -> None:
    _expect(isinstance(max_chars, int) and max_chars >= 1, f"max_chars: a whole number >= 1, got {max_chars!r}")
    _expect(isinstance(buffer_chars, int) and 0 <= buffer_chars <= max_chars,
            f"buffer_chars: a whole number in [0, max_chars], got {buffer_chars!r}")


# ------------------------------------------------------------------------------------------ regex

RegexMode = Literal["search", "fullmatch", "match"]
_REGEX_MODES: dict[str, Callable[[re.Pattern[str], str], re.Match[str] | None]] = {
    "search": re.Pattern.search, "fullmatch": re.Pattern.fullmatch, "match": re.Pattern.match,
}
_REGEX_FLAGS: dict[str, re.RegexFlag] = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _compile(pattern: str, flags: str) -> re.Pattern[str]:
    bits = 0
    for letter in flags:
        bits |= _REGEX_FLAGS[letter]
    return re.compile(pattern, bits)  # re keeps its own cache of compiled patterns


def regex(completion: str, prompt: str, metadata: dict[str, Any], *, pattern: str | None = None,
          pattern_key: str = "pattern", mode: RegexMode = "search", flags: str = "",
          strip: bool = True) -> float:
    """1.0 when the pattern matches the completion (``search``, ``fullmatch`` or ``match``), else 0.0.

    The pattern comes from the params, else from ``metadata[pattern_key]`` (a per-prompt pattern). Special-token
    markers are cut off and, with ``strip``, surrounding whitespace too. Never runs inline: a user pattern can
    backtrack catastrophically, and only the pool's timeout can stop that.
    """
    del prompt
    if pattern is None:
        pattern = metadata.get(pattern_key)
        if not isinstance(pattern, str):
            raise ValueError(f"no pattern in params and no string metadata[{pattern_key!r}]")
    text = cut_special(completion)
    text = text.strip() if strip else text
    return 1.0 if _REGEX_MODES[mode](_compile(pattern, flags), text) else 0.0


def _check_regex(pattern: str | None = None, pattern_key: str = "pattern", mode: str = "search",
                 flags: str = "", strip: bool = True) -> None:
    _expect(mode in _REGEX_MODES, f"mode: {mode!r} is not one of {sorted(_REGEX_MODES)}")
    _expect(isinstance(flags, str) and set(flags) <= set(_REGEX_FLAGS),
            f"flags: {flags!r}: use letters of {''.join(_REGEX_FLAGS)}")
    _expect(isinstance(pattern_key, str) and isinstance(strip, bool), "pattern_key: a string; strip: a bool")
    if pattern is not None:
        _expect(isinstance(pattern, str), "pattern: must be a string")
        try:
            _compile(pattern, flags)
        except re.error as exc:
            raise ValueError(f"pattern: {pattern!r} does not compile: {exc}") from None


# ------------------------------------------------------------------------------------------ format

FormatMode = Literal["all", "fraction"]
_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]*")


def _tags_found(text: str, tags: Sequence[str], ordered: bool) -> tuple[int, str]:
    """How many ``<tag>...</tag>`` pairs are present (in order when ``ordered``) and the text outside them."""
    pos, found, outside = 0, 0, []
    for tag in tags:
        opener, closer = f"<{tag}>", f"</{tag}>"
        start = text.find(opener, pos if ordered else 0)
        end = text.find(closer, start + len(opener)) if start >= 0 else -1
        if end < 0:
            continue
        found += 1
        if ordered:
            outside.append(text[pos:start])
            pos = end + len(closer)
    outside.append(text[pos:] if ordered else "")
    return found, "".join(outside)


def format_reward(completion: str, prompt: str, metadata: dict[str, Any], *,
                  tags: Sequence[str] = ("think", "answer"), mode: FormatMode = "all", ordered: bool = True,
                  strict: bool = False) -> tuple[float, dict[str, Any]]:
    """Reward for the required ``<tag>...</tag>`` structure, e.g. ``<think>...</think><answer>...</answer>``.

    ``all``: 1.0 only when every tag pair is present; ``fraction``: the share present (partial credit shapes
    early training). ``ordered``: each pair must start after the previous one closed. ``strict`` (with
    ``ordered``): only whitespace may appear outside the tags. Plain ``str.find``, linear in the length, so it
    is safe to run inline.
    """
    del prompt, metadata
    text = cut_special(completion)
    found, outside = _tags_found(text, tags, ordered)
    if strict and ordered and outside.strip():
        found = 0
    share = found / len(tags)
    reward = share if mode == "fraction" else float(found == len(tags))
    return reward, {"tags_found": found}


def _check_format(tags: Sequence[str] = ("think", "answer"), mode: str = "all", ordered: bool = True,
                  strict: bool = False) -> None:
    _expect(mode in ("all", "fraction"), f"mode: {mode!r} is not one of ['all', 'fraction']")
    _expect(isinstance(tags, list | tuple) and len(tags) > 0, "tags: a non-empty list of tag names")
    for tag in tags:
        _expect(isinstance(tag, str) and _TAG_NAME.fullmatch(tag) is not None, f"tags: {tag!r} is not a tag name")
    _expect(isinstance(ordered, bool) and isinstance(strict, bool), "ordered/strict: must be true or false")


# ------------------------------------------------------------------------------------------ the registry


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class Builtin:
    """A registry entry: the function plus what the pool needs to know about it."""

    fn: RewardFn
    check: Callable[..., None]  # raises ValueError/TypeError on bad params (called with the params as kwargs)
    inline_safe: bool  # bounded, non-backtracking work on bounded input: may run in the verifier process
    warmup: Callable[[], None] | None = None
    warm_always: bool = True  # False: warm up only where a by_task term names it (tasks merely named so: lazily)


BUILTINS: dict[str, Builtin] = {
    "exact": Builtin(exact, _check_exact, inline_safe=True),
    "positions": Builtin(positions, _check_positions, inline_safe=True),
    "format": Builtin(format_reward, _check_format, inline_safe=True),
    "overlong": Builtin(overlong, _check_overlong, inline_safe=True),
    "regex": Builtin(regex, _check_regex, inline_safe=False),
    "math": Builtin(math_reward.math_answer, math_reward.check_params, inline_safe=False, warmup=math_reward.warmup),
    "reasoning_gym": Builtin(reasoning_gym_reward.score, reasoning_gym_reward.check_params, inline_safe=False,
                             warmup=reasoning_gym_reward.warmup, warm_always=False),
}


def resolve(name: str) -> RewardFn:
    """A built-in by name, ``"package.module:function"`` imported (ImportError/AttributeError/ValueError), or
    ``"trl:package.module:function"``: a TRL-convention reward function, adapted (``rewards.trl_style``)."""
    if name in BUILTINS:
        return BUILTINS[name].fn
    if name.startswith(trl_style.PREFIX):
        return trl_style.as_reward(resolve(name[len(trl_style.PREFIX):]))
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is neither a built-in ({sorted(BUILTINS)}) nor 'package.module:function'")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{name!r} is not callable")
    return fn
