"""The ``math`` reward: equivalence of the model's final answer and the gold answer, decided by ``math-verify``.

Gold (``metadata["answer"]``, or a list of acceptable answers): a GSM8K solution keeps only what follows the
last ``####``; surrounding ``$`` and ``\\$`` are dropped, a ``\\boxed{}`` gold is unwrapped; the text is then
parsed as the content of ``$\\boxed{...}$`` (so ``3/4``, ``\\frac12``, ``1,000``, ``0.5`` and ``x+1`` all parse),
falling back to math-verify's free-text extraction, and finally to the plain string.

Prediction: the content of the completion's *last* ``\\boxed{...}``/``\\fbox{...}`` when it has one (a model
that corrects itself boxes twice; math-verify alone would read both as a set), else math-verify's extraction on
the last ``tail_chars`` characters ("final answer is" anchors first, then the last number or expression).

math-verify bounds each parse/compare with ``signal.alarm``, which only works in a process's main thread. Pool
workers run rewards in their main thread, so its timeouts stay on there; in any other thread they are turned off
and the pool's per-call timeout is the only bound. ``math_verify`` is imported on first use (about a second:
sympy and an ANTLR parser), which a worker does in :func:`warmup` before it reports ready.
"""

from __future__ import annotations

import re
import threading
from typing import Any, cast

# Unicode minus and friends -> ASCII, which math-verify does not do itself ("−3" would not parse).
_TRANSLATE = str.maketrans({"\u2212": "-", "\u2013": "-", "\u00a0": " ", "\u2009": " "})
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None when there is none or it is cut off."""
    at = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if at < 0:
        return None
    open_at = text.find("{", at)
    if open_at < 0 or text[at:open_at].strip() not in _BOX_COMMANDS:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def gold_text(answer: str) -> str:
    """The bare gold answer: after the last ``####``, without ``$`` wrappers, a ``\\boxed{}`` unwrapped."""
    text = answer.rsplit("####", 1)[-1].translate(_TRANSLATE).replace("\\$", "").strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = text.strip().strip("$").strip()
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def _timeout(seconds: int) -> int | None:
    """math-verify's own timeout, only where signal.alarm works (see the module docstring)."""
    return seconds if seconds > 0 and threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str, parse_timeout_s: int = 3) -> list[Any]:
    """math-verify's parse of a gold answer; the plain text when nothing parses (compared as a string)."""
    from math_verify import parse

    text = gold_text(answer)
    if not text:
        return []
    timeout = _timeout(parse_timeout_s)
    for candidate in (f"$\\boxed{{{text}}}$", text):
        parsed: list[Any] = parse(candidate, parsing_timeout=timeout)
        if parsed:
            return parsed
    return [text]


def parse_prediction(completion: str, tail_chars: int = 4000, parse_timeout_s: int = 3) -> list[Any]:
    """math-verify's parse of the model's final answer (last box, else the tail of the text)."""
    from math_verify import parse

    text = completion.translate(_TRANSLATE)
    timeout = _timeout(parse_timeout_s)
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        parsed: list[Any] = parse(f"$\\boxed{{{boxed}}}$", parsing_timeout=timeout)
        return parsed or [boxed.strip()]
    return cast(list[Any], parse(text[-tail_chars:], parsing_timeout=timeout))


def math_answer(completion: str, prompt: str, metadata: dict[str, Any], *, tail_chars: int = 4000,
         parse_timeout_s: int = 3, verify_timeout_s: int = 3, float_rounding: int = 6,
         strict: bool = True) -> tuple[float, dict[str, Any]]:
    """1.0 when the completion's final answer is mathematically equivalent to a gold answer, else 0.0."""
    from math_verify import verify

    from grpo_verifiers.rewards.builtins import answers_of, cut_special

    del prompt
    golds = [parse_gold(a, parse_timeout_s) for a in answers_of(metadata)]
    pred = parse_prediction(cut_special(completion), tail_chars, parse_timeout_s)
    info: dict[str, Any] = {"pred": str(pred[-1])[:64] if pred else None}
    if not pred:
        return 0.0, info
    timeout = _timeout(verify_timeout_s)
    ok = any(gold and verify(gold, pred, float_rounding=float_rounding, strict=strict, timeout_seconds=timeout)
             for gold in golds)
    return (1.0 if ok else 0.0), info


def check_params(tail_chars: int = 4000, parse_timeout_s: int = 3, verify_timeout_s: int = 3,
                 float_rounding: int = 6, strict: bool = True) -> None:
    """Config-time validation of the ``math`` params (see :mod:`grpo_verifiers.rewards.builtins`)."""
    ints = {"tail_chars": tail_chars, "parse_timeout_s": parse_timeout_s, "verify_timeout_s": verify_timeout_s,
            "float_rounding": float_rounding}
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: must be an integer >= 0 (math-verify timeouts are whole seconds), got {value!r}")
    if tail_chars < 16:
        raise ValueError("tail_chars: must be >= 16")
    if not isinstance(strict, bool):
        raise ValueError("strict: must be true or false")


def warmup() -> None:
    """Import math-verify and run one parse/verify, so a fresh worker's first real call is not the slow one."""
    from math_verify import parse, verify

    timeout = _timeout(3)
    verify(parse("$\\boxed{\\frac{1}{2}}$", parsing_timeout=timeout), parse("0.5", parsing_timeout=timeout),
           timeout_seconds=timeout)
