"""What a reward that did not produce a score means: a real 0, or a failure that must never become training signal.

Every reason a record can score without a value (``RewardResult.error``, see ``grpo_verifiers.rewards.pool``)
has one declared policy, :data:`POLICY`, keyed by the reason's kind (the text before the first ``:``):

=================  ======  ===========================================================================
kind               policy  why
=================  ======  ===========================================================================
``empty``          zero    the completion itself is empty: the model earned its 0
``oversized``      zero    the completion itself is longer than ``max_completion_chars``
``invalid_utf8``   zero    the completion's own bytes are not text
``timeout``        fail    a hung worker is infrastructure, unless the term declares ``zero_on: [timeout]``
``crash``          fail    a worker died (segfault, OOM kill)
``memory``         fail    ``MemoryError`` under the worker's cap (``zero_on: [memory]`` to blame the input)
``exception``      fail    the reward raised: a bug in the reward, not a verdict on the completion
``non_finite``     fail    NaN/inf from the reward
``out_of_range``   fail    a value outside [0, 1]
``bad_result``     fail    not a number
``bad_reply``      fail    a worker's reply did not match the record (a pool bug)
``bad_input``      fail    the record's metadata cannot be used (a dataset problem, not the model's); a
                          reward says so by raising :class:`BadInput`
``unknown_task``   fail    no reward is configured for the task
``pool_error``     fail    the pool itself failed; ``pool_unavailable``: no worker could start
=================  ======  ===========================================================================

``fail`` means: the pool retries the record (``rewards.retries`` times), and if it still fails the verifier
publishes the member in the group's ``failed`` list with a placeholder reward; the learner leaves it out of the
group statistics and the loss, and drops the group when fewer than ``learner.min_valid_rewards`` members are
left (lineage reason ``reward_failed``). A term may declare that some of its failures are the completion's fault
(``zero_on``, e.g. ``[timeout]`` for a math checker that a pathological expression can hang): those score 0.
Kinds not in the table (a new reason added without a policy) fail: being wrong that way costs a sample, the
other way a false training signal.
"""

from __future__ import annotations

from typing import Literal

Policy = Literal["zero", "fail"]

POLICY: dict[str, Policy] = {
    "empty": "zero", "oversized": "zero", "invalid_utf8": "zero",
    "timeout": "fail", "crash": "fail", "memory": "fail", "exception": "fail", "non_finite": "fail",
    "out_of_range": "fail", "bad_result": "fail", "bad_reply": "fail", "bad_input": "fail",
    "unknown_task": "fail", "pool_error": "fail", "pool_unavailable": "fail",
}
# A term may move these kinds to "zero" (they can be caused by the input itself); the others stay as declared.
ZEROABLE = frozenset({"timeout", "memory", "exception", "crash"})
# Retrying these cannot change the outcome: the same config or the same bytes give the same answer.
DETERMINISTIC = frozenset({"unknown_task", "bad_input", "empty", "oversized", "invalid_utf8"})


class BadInput(ValueError):
    """Raised by a reward when the record's metadata cannot be used (missing or malformed): ``bad_input``, a
    failure that is not retried, instead of the ``exception`` a bug in the reward is."""


def kind(reason: str) -> str:
    """The kind of a reason: ``"exception: ValueError: x"`` -> ``"exception"``, ``"crash: signal 9"`` -> ``"crash"``."""
    return reason.split(":", 1)[0].strip()


def policy(reason: str, zero_on: frozenset[str] = frozenset()) -> Policy:
    """The declared policy of a failure ``reason`` for a term that declares ``zero_on``."""
    k = kind(reason)
    if k in zero_on and k in ZEROABLE:
        return "zero"
    return POLICY.get(k, "fail")


def retriable(reason: str) -> bool:
    """Whether another try may give a score (a hung or crashed worker may not hang or crash again)."""
    return kind(reason) not in DETERMINISTIC
