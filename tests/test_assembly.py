"""Group assembly as pure bookkeeping: completion, timeouts and the low watermark, without a broker."""

from __future__ import annotations

import numpy as np

from grpo_core import wire
from grpo_verifiers.assembly import GroupAssembler

G = 3


def member(gid: str, index: int) -> wire.Completion:
    return wire.Completion(
        group_id=gid, index=index, group_size=G, prompt_id=gid, task="exact",
        prompt_token_ids=np.arange(2, dtype=np.int32), completion_token_ids=np.arange(1, dtype=np.int32),
        behaviour_logprobs=np.zeros(1, dtype=np.float32), policy_version=0, producer_id="p",
        finish_reason="stop", metadata={"attempt": "a"})


def test_a_group_completed_after_its_timeout_is_handed_out_once() -> None:
    """The last member arrives past the timeout, in the same poll that resolves expired groups: the group is
    complete, so it is not also resolved as partial (it was published twice, the second copy partial)."""
    a = GroupAssembler()
    assert a.add(0, 0, member("g", 0), None, now=0.0) is None
    assert a.add(0, 1, member("g", 1), None, now=1.0) is None
    ready = a.add(0, 2, member("g", 2), None, now=100.0)
    assert ready is not None and [m.offset for m in ready.members] == [0, 1, 2] and not ready.partial
    assert a.expired(60.0, now=100.0) == []
    assert a.watermark(0) == 0  # still pending until published: the offset rule holds
    a.done(0, "g")
    assert a.watermark(0) == 3


def test_an_incomplete_group_expires() -> None:
    a = GroupAssembler()
    a.add(0, 5, member("h", 0), None, now=0.0)
    assert [g.group_id for g in a.expired(60.0, now=61.0)] == ["h"]
    assert a.expired(60.0, now=59.0) == []
