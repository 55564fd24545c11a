"""Reward functions for tests/test_rewards.py, loaded by dotted path ("reward_fixtures:NAME") inside pool workers.

Several misbehave on purpose -- hang, raise, exhaust memory, segfault, return garbage -- so the tests can check
that each one costs a single record a zero with a reason, and never the pool.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any


def contains_answer(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """A trivial, well-behaved pooled reward: is the answer anywhere in the completion."""
    return 1.0 if str(metadata.get("answer", "")) in completion else 0.0


def length_ratio(completion: str, prompt: str, metadata: dict[str, Any], *, target: int = 10) -> tuple[float, dict]:
    """A custom reward with a param and info: closeness of the completion's length to ``target``."""
    n = len(completion)
    return min(n, target) / max(n, target), {"length": n}


def sleep_forever(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Hangs: only the pool's timeout (kill + replace) ends it."""
    time.sleep(3600)
    return 1.0


def raises(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    raise ValueError("boom")


def allocate_2gb(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Allocates without bound: 2 GiB at once, beyond the worker's RLIMIT_AS."""
    blob = bytearray(2 * 1024**3)
    return float(len(blob) > 0)


def allocate_gradually(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Grows 16 MiB at a time until the address-space cap stops it."""
    chunks = []
    while True:
        chunks.append(bytearray(16 * 2**20))


def segfault(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Kills its worker with SIGSEGV (reads address 0)."""
    ctypes.string_at(0)
    return 1.0


def exits(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    sys.exit(3)


def nan(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    return float("nan")


def too_big(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    return 1.5


def not_a_number(completion: str, prompt: str, metadata: dict[str, Any]) -> str:
    return "yes"


def unserialisable_info(completion: str, prompt: str, metadata: dict[str, Any]) -> tuple[float, dict]:
    return 1.0, {"obj": object()}


NOT_CALLABLE = 42


def nap(completion: str, prompt: str, metadata: dict[str, Any], *, seconds: float = 0.3) -> float:
    """Slow but well-behaved: shows that a batch runs on all workers at once."""
    time.sleep(seconds)
    return 1.0


def crashes_once(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Kills its worker the first time it sees ``metadata["marker"]`` (a path), then scores 1: a transient fault."""
    marker = Path(metadata["marker"])
    if not marker.exists():
        marker.write_text("crashed")
        os._exit(7)
    return 1.0


def fails_on_word(completion: str, prompt: str, metadata: dict[str, Any], *, word: str = "FAIL") -> float:
    """A reward with a bug that some completions trigger: raises on ``word``, else exact match with the answer."""
    if word in completion:
        raise RuntimeError(f"cannot parse {word}")
    return float(completion == str(metadata.get("answer")))


# ---- written the TRL way (GRPOTrainer's reward_funcs), used through "trl:reward_fixtures:NAME" --------------

def trl_accuracy(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """As for ``GRPOTrainer(reward_funcs=[trl_accuracy])``: one value per completion from the ``answer`` column,
    None where the ``kind`` column says the function does not apply; chat completions are message lists."""
    kinds = kwargs.get("kind", [None] * len(completions))
    out: list[float | None] = []
    for prompt, completion, truth, kind in zip(prompts, completions, answer, kinds, strict=True):
        if kind == "skip":
            out.append(None)
            continue
        if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
            assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"
            completion = completion[0]["content"]
        out.append(1.0 if completion.strip() == str(truth) else 0.0)
    return out


def trl_too_many(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """Returns two values for one completion: the adapter says so instead of guessing."""
    return [1.0, 1.0]


def not_trl(completion: str, prompt: str, metadata: dict[str, Any]) -> float:
    """The per-completion convention: named with trl: by mistake, it fails at config load."""
    return 1.0
