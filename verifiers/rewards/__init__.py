"""The verifier's rewards library: reward functions, their per-task combination, and the sandbox that runs them.

A reward function is any callable

    fn(completion: str, prompt: str, metadata: dict[str, Any], **params) -> float | tuple[float, dict]

returning a reward in [0, 1], optionally with a small JSON-able ``info`` dict (kept per term in the result).
``completion`` is valid UTF-8 text, non-empty and at most ``max_completion_chars`` long (checked before any call);
``metadata`` is the prompt's metadata (e.g. ``{"answer": "72"}``; a list answer means "any of these"); ``params``
are the term's configured keyword arguments. Anything else it does -- raise, hang, crash the interpreter, exhaust
memory, return NaN or 1.5 -- costs that record a 0 with a reason, never the verifier.

Rewards are named in the config either by a built-in name (:data:`BUILTINS`: ``exact``, ``positions``, ``regex``,
``format``, ``overlong``, ``math``, ``reasoning_gym``) or by a dotted path ``"package.module:function"``.
:class:`RewardConfig` maps tasks to weighted terms; :class:`RewardPool` scores batches of :class:`RewardRequest`
into :class:`RewardResult`.
"""

from grpo_verifiers.rewards.builtins import BUILTINS, Builtin, resolve
from grpo_verifiers.rewards.config import RewardConfig, RewardTerm
from grpo_verifiers.rewards.pool import RewardPool, RewardRequest, RewardResult, check_request
from grpo_verifiers.rewards.registry import TermOutcome, call_term

__all__ = [
    "BUILTINS", "Builtin", "RewardConfig", "RewardPool", "RewardRequest", "RewardResult", "RewardTerm",
    "TermOutcome", "call_term", "check_request", "resolve",
]
