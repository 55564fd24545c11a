"""Where the learner's groups come from: the ``groups`` topic, read in order, with its exactly-once bookkeeping.

Exactly-once, the rule: records of a partition are read in offset order and queued in arrival order; a batch
takes a prefix of that queue (the groups it trains plus every record dropped or dead-lettered before them). So
per partition the records a batch *accounts for* are a prefix too, and "the next offset to read" after the batch
is one number per partition. The learner stores those numbers in the checkpoint with the model that contains
the batch; after a crash it seeks there, so a group is in the model exactly once: never skipped (everything
after the checkpoint is re-read) and never twice (everything before it is not). Consumer-group commits exist
only so Kafka lag tools (and the producers' backpressure) see the learner's progress.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_core import wire
from grpo_core.kafka_io import Consumer, DeadLetters, Partition, commit_processed, poll, with_retry
from grpo_core.staleness import from_the_future, staleness, too_stale
from grpo_core.stats import is_zero_variance

log = logging.getLogger(__name__)


@dataclass
class Item:
    """One record of the groups topic, in arrival order; ``group`` is None once it was dead-lettered."""

    partition: int
    offset: int
    group: wire.ScoredGroup | None
    reason: str = ""
    group_id: str = ""  # kept for the lineage when a decodable but invalid group was dead-lettered
    failed: int = 0  # members whose reward failed, already removed from ``group`` (ScoredGroup.valid_part)


@dataclass
class Pick:
    """What one learner step consumes: groups to train, groups dropped on the way, the resulting position."""

    trained: list[Item] = field(default_factory=list)
    dropped: list[Item] = field(default_factory=list)
    next_offsets: dict[int, int] = field(default_factory=dict)
    wait_s: float = 0.0


@dataclass
class SourceRules:
    """The admission rules applied to each group (from the learner config)."""

    group_size: int
    accept_partial: bool
    max_staleness: int
    max_seq_len: int
    drop_zero_variance: bool
    min_valid_rewards: int = 2


class GroupSource:
    def __init__(self, consumer: Consumer, topic: str, dead: DeadLetters, rules: SourceRules,
                 dedup_window: int) -> None:
        self.consumer, self.topic, self.dead, self.rules = consumer, topic, dead, rules
        self.queue: deque[Item] = deque()
        self.position: dict[int, int] = {}  # next offset per partition, of what batches accounted for
        self.seen: OrderedDict[str, None] = OrderedDict()  # trained group ids (duplicates are ignored)
        self.unsaved: list[str] = []  # the ones trained since the last checkpoint (``grpo_learner.seen_log``)
        self.dedup_window = dedup_window
        self.newest_announced = -1  # the highest version this run has announced (the learner keeps it current)
        self.visible: dict[int, int] = {}  # the consumer group's committed offsets (for lag and backpressure)
        self.last_arrival = time.monotonic()

    # ---- start-up ----------------------------------------------------------------------------------
    def start(self, offsets: dict[int, int] | None, start_from: str) -> None:
        """Assign every partition and seek to the checkpoint's offsets (or the start policy without one)."""
        def partitions() -> set[int]:
            found: set[int] | None = self.consumer.partitions_for_topic(self.topic)
            if not found:
                raise TimeoutError(f"topic {self.topic} has no partitions (create it: grpo-stream topics create)")
            return found

        parts = sorted(with_retry(partitions, f"learner: metadata of {self.topic}"))
        tps = [Partition(self.topic, p) for p in parts]
        self.consumer.assign(tps)
        for tp in tps:
            if offsets is not None and tp.partition in offsets:
                self.consumer.seek(tp, offsets[tp.partition])
            elif start_from == "latest":
                self.consumer.seek_to_end(tp)
            else:
                self.consumer.seek_to_beginning(tp)
        for tp in tps:
            self.position[tp.partition] = self.consumer.position(tp)
        log.info("learner reads %s from %s", self.topic, self.position)
        self._say_which_offsets_win(tps)

    def _say_which_offsets_win(self, tps: list[Partition]) -> None:
        """THE operator rule, said where it applies: the learner reads from its checkpoint, never from its consumer
        group's committed offsets (exactly once needs offsets and model state from the same moment), so a reset
        of the group with Kafka's tools changes nothing here. Skipping records is deliberate: ``skip_to``."""
        # (mypy cannot infer a lambda with a default argument: the ignore below)
        committed = {tp.partition: with_retry(lambda t=tp: self.consumer.committed(t),  # type: ignore[misc]
                                              "learner: committed")
                     for tp in tps}
        differ = {p: o for p, o in committed.items() if o is not None and o != self.position[p]}
        if differ:
            log.warning("consumer group committed %s, the checkpoint says %s: the checkpoint wins (exactly once); "
                        "to skip records on purpose, restart with skip_to={partition: offset} (recorded in the "
                        "lineage as operator_skip)", differ, {p: self.position[p] for p in differ})

    def skip_to(self, targets: dict[int, int]) -> list[dict[str, int]]:
        """Move forward to ``targets`` (partition -> next offset) where they lie ahead; returns the skipped ranges
        ``{partition, from, to}`` (``to`` exclusive) for the lineage. Never moves backwards."""
        skipped = []
        for partition, offset in sorted(targets.items()):
            if partition not in self.position:
                raise ValueError(f"skip_to: {self.topic} has no partition {partition} (it has {sorted(self.position)})")
            if offset > self.position[partition]:
                skipped.append({"partition": partition, "from": self.position[partition], "to": offset})
                self.consumer.seek(Partition(self.topic, partition), offset)
                self.position[partition] = offset
        return skipped

    def restore_seen(self, ids: list[str]) -> None:
        self.seen = OrderedDict.fromkeys(ids[-self.dedup_window:])
        self.unsaved = []

    def take_unsaved(self) -> list[str]:
        """The ids trained since the last call, for the checkpoint being written."""
        ids, self.unsaved = self.unsaved, []
        return ids

    # ---- batches -----------------------------------------------------------------------------------
    def next_batch(self, step: int, size: int, should_stop: Callable[[], bool], poll_ms: int,
                   flush_after_s: float = 0.0) -> Pick | None:
        """Block until ``size`` admissible groups are queued, then take them (and the drops before them). With
        ``flush_after_s`` > 0, fewer do once no record arrived for that long (the tail of a finite feed), and
        a queue with nothing trainable in it is taken as drops alone (``trained`` empty: no step): a tail of
        only stale groups was never accounted for before, so the run never drained.

        Returns None when ``should_stop()`` turns true first (nothing is taken then)."""
        t0 = time.monotonic()
        while (ready := self._admissible(step)) < size:
            if flush_after_s > 0 and self.queue and time.monotonic() - self.last_arrival >= flush_after_s:
                size = ready  # 0: every queued group is a drop (stale, duplicate, ...) and stays one
                break
            if should_stop():
                return None
            self._poll(poll_ms, max(size * 2, 16), step)
            self._show_read()
        pick = self._take(step, size)
        pick.wait_s = time.monotonic() - t0
        return pick

    def commit(self) -> None:
        """Publish progress to the consumer group (visibility only; the checkpoint is the source of truth)."""
        self._show_read(force=True)  # also after a commit the broker did not take

    def _show_read(self, force: bool = False) -> None:
        """Commit past every record this learner has read: the ones its steps accounted for and the ones queued.

        Visibility only (exactly once rests on the checkpoint's offsets). The producers measure their backlog
        from this offset, so what counts against it is what the learner has not read yet. Queued groups must not:
        the stale ones can never be trained, and with a tight staleness bound they held generation back while
        the learner waited for fresh groups (the pipeline stood still). Committing past only a droppable head
        was not enough: one fresh group at the head kept every stale group behind it in the backlog (seen in
        the lockstep run: producers paused at backlog 22 of 16, the learner waiting with fewer than B fresh).
        The queue holds fewer than 3 B admissible groups (it polls at most 2 B records at a time while it has
        fewer than B), so the lag under-counts the learner's work by that much at most. The drops are still
        accounted for in the lineage line and the checkpoint of the step that takes them."""
        visible = dict(self.visible)
        for p, o in self.position.items():
            visible[p] = max(o, visible.get(p, 0))
        for item in self.queue:
            visible[item.partition] = max(visible.get(item.partition, 0), item.offset + 1)
        if (force or visible != self.visible) and commit_processed(
                self.consumer, {Partition(self.topic, p): o for p, o in visible.items()}):
            self.visible = visible

    def _poll(self, poll_ms: int, max_records: int, step: int) -> None:
        for tp, msgs in poll(self.consumer, poll_ms, max_records).items():
            self.last_arrival = time.monotonic()
            for msg in msgs:
                group, reason = self.dead.decode_or_reason(msg, wire.ScoredGroup)
                item = Item(tp.partition, msg.offset, group, reason)
                if group is not None and (reason := self._invalid(group, step)):
                    self.dead.send(msg, f"{reason}: group {group.group_id}")
                    item.group, item.reason, item.group_id = None, reason, group.group_id
                elif group is not None and group.failed:
                    # Failed rewards are no signal: they leave the statistics and the loss here, before anything
                    # (zero-variance, advantages) looks at the rewards.
                    item.failed, item.group = len(group.failed), group.valid_part()
                self.queue.append(item)

    def _invalid(self, g: wire.ScoredGroup, step: int) -> str:
        """Why a decodable group still cannot be trained (it then goes to the dlq), or ''."""
        r = self.rules
        if from_the_future(g.newest_version, step, self.newest_announced):
            return (f"future_version: v{g.newest_version} was never announced (newest v{self.newest_announced}, "
                    f"learner step {step})")
        if g.group_size != r.group_size:
            return (f"wrong_group_size: the group says G={g.group_size}, the pipeline contract "
                    f"G={r.group_size}")
        if g.partial and not r.accept_partial:
            return "partial_group"
        longest = max((len(c.prompt_token_ids) + len(c.completion_token_ids) for c in g.completions), default=0)
        if r.max_seq_len and longest > r.max_seq_len:
            return f"too_long: {longest} tokens > max_seq_len {r.max_seq_len}"
        return ""

    def _drop_reason(self, item: Item, step: int) -> str:
        """Why a valid group is skipped at ``step``, or '' if it is trained."""
        g = item.group
        if g is None:
            return item.reason
        if g.group_id in self.seen:
            return "duplicate"
        if too_stale(step, g.policy_version, self.rules.max_staleness):
            return "stale"
        if item.failed and len(g.completions) < self.rules.min_valid_rewards:
            return "reward_failed"
        if self.rules.drop_zero_variance and is_zero_variance(g.rewards):
            return "zero_variance"
        return ""

    def _admissible(self, step: int) -> int:
        seen_now: set[str] = set()
        n = 0
        for item in self.queue:
            if not self._drop_reason(item, step):
                assert item.group is not None  # an item without a group always has a reason to drop
                if item.group.group_id not in seen_now:
                    seen_now.add(item.group.group_id)
                    n += 1
        return n

    def _take(self, step: int, size: int) -> Pick:
        pick = Pick()
        while len(pick.trained) < size or (size == 0 and self.queue):
            item = self.queue.popleft()
            item.reason = self._drop_reason(item, step)
            if item.reason:
                pick.dropped.append(item)
            else:
                assert item.group is not None  # an item without a group always has a reason to drop
                self._remember(item.group.group_id)
                pick.trained.append(item)
            self.position[item.partition] = item.offset + 1
        pick.next_offsets = dict(self.position)
        return pick

    def _remember(self, group_id: str) -> None:
        self.seen[group_id] = None
        self.unsaved.append(group_id)
        while len(self.seen) > self.dedup_window:
            self.seen.popitem(last=False)


def lineage_entries(pick: Pick, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The lineage view of a pick (``step`` = the learner step the batch was trained at)."""
    def entry(item: Item) -> dict[str, Any]:
        g = item.group
        base = {"partition": item.partition, "offset": item.offset}
        if g is None:
            return base | ({"group_id": item.group_id} if item.group_id else {})
        span = {"newest_version": g.newest_version} if g.newest_version != g.policy_version else {}
        return base | {"group_id": g.group_id, "version": g.policy_version,
                       "staleness": staleness(step, g.policy_version)} | span | (
                           {"reward_failed": item.failed} if item.failed else {})

    trained = [entry(i) for i in pick.trained]
    dropped = [entry(i) | {"reason": i.reason} for i in pick.dropped]
    return trained, dropped
