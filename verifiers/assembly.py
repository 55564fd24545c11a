"""Group assembly and the verifier's offset rule, as pure bookkeeping (no Kafka, no rewards).

Completions of one group share a key, so they arrive in one partition, in order. A group is complete when one
*attempt* has all G members (a producer that crashed mid-batch and was re-run publishes a second attempt:
members of different attempts are never mixed, so a group never spans two generations; its version is its
oldest member's, as an in-flight weight update can start some members under a newer one).
Duplicates -- the same (group, attempt, index), or anything of a group already published -- are ignored.

The offset rule (the low watermark): a completions offset may be committed only when every record at or below
it is *done*: its group was published (or dead-lettered), or it was a duplicate or undecodable. So per
partition the commit point is the lowest offset of any record of a still-pending group, or one past the last
record read when nothing is pending. After a crash everything from that point is read again, which rebuilds the
unfinished groups; groups that had completed above it are rebuilt and published again (downstream dedups by
group id), which is the only way a duplicate ScoredGroup appears.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from grpo_core import wire


@dataclass
class Member:
    completion: wire.Completion
    offset: int
    msg: Any  # the ConsumerRecord, kept to dead-letter an incomplete group with its original coordinates


@dataclass
class Pending:
    group_id: str
    partition: int
    group_size: int
    first_offset: int
    first_seen: float
    attempts: dict[str, dict[int, Member]] = field(default_factory=dict)
    complete: bool = False  # handed out whole; pending only until it is published (the offset rule)

    def best(self) -> dict[int, Member]:
        """The attempt with the most members (the earliest on ties)."""
        return max(self.attempts.values(), key=len)


@dataclass
class Ready:
    """A group to score and publish: its members in index order; ``partial`` when the timeout forced it."""

    group_id: str
    partition: int
    members: list[Member]
    partial: bool = False


class GroupAssembler:
    def __init__(self, published_window: int = 200_000) -> None:
        self.pending: dict[tuple[int, str], Pending] = {}
        self.read_up_to: dict[int, int] = {}  # next offset after the last record read, per partition
        self.published: OrderedDict[str, None] = OrderedDict()
        self.published_window = published_window
        self.dedup_hits = 0

    def add(self, partition: int, offset: int, c: wire.Completion, msg: Any, now: float | None = None) -> Ready | None:
        """Take one decoded completion; return the group if this member completed it."""
        self.read_up_to[partition] = max(self.read_up_to.get(partition, 0), offset + 1)
        if c.group_id in self.published:
            self.dedup_hits += 1
            return None
        key = (partition, c.group_id)
        group = self.pending.get(key)
        if group is None:
            group = self.pending[key] = Pending(c.group_id, partition, c.group_size, offset,
                                                time.monotonic() if now is None else now)
        attempt = str(c.metadata.get("attempt", ""))
        members = group.attempts.setdefault(attempt, {})
        if c.index in members or c.group_size != group.group_size:
            self.dedup_hits += 1  # a re-delivered or conflicting copy: the first one stays
            return None
        members[c.index] = Member(c, offset, msg)
        if len(members) < group.group_size:
            return None
        group.complete = True
        return Ready(c.group_id, partition, [members[i] for i in sorted(members)])

    def skip(self, partition: int, offset: int) -> None:
        """An undecodable record (already dead-lettered) is done as soon as it is read."""
        self.read_up_to[partition] = max(self.read_up_to.get(partition, 0), offset + 1)

    def expired(self, timeout_s: float, now: float | None = None) -> list[Pending]:
        """Incomplete groups older than ``timeout_s``. A group completed late is not one of them: it was handed
        out whole and must not be resolved a second time, as partial."""
        now = time.monotonic() if now is None else now
        return [g for g in self.pending.values() if not g.complete and now - g.first_seen >= timeout_s]

    def done(self, partition: int, group_id: str) -> None:
        """The group was published (acked) or dead-lettered: forget it, remember its id for dedup."""
        self.pending.pop((partition, group_id), None)
        self.published[group_id] = None
        while len(self.published) > self.published_window:
            self.published.popitem(last=False)

    def watermark(self, partition: int) -> int | None:
        """THE commit point for ``partition`` (see the module docstring); None if nothing was read there."""
        lows = [g.first_offset for (p, _), g in self.pending.items() if p == partition]
        if lows:
            return min(lows)
        return self.read_up_to.get(partition)

    def forget_partition(self, partition: int) -> None:
        """On revocation: the new owner rebuilds this partition's pending groups from the committed point."""
        for key in [k for k in self.pending if k[0] == partition]:
            del self.pending[key]
        self.read_up_to.pop(partition, None)
