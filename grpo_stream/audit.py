"""The reconciliation of a run: what was fed, produced, trained, dropped and dead-lettered, read back from the
topics, the learner's newest checkpoint and its lineage, and checked against the exactly-once promises.

The promises, each a number that must be 0:

- ``trained_twice``: a group id in more than one lineage entry of the checkpointed lineage.
- ``offsets_unaccounted``: a ``groups`` offset below the checkpoint's position in no lineage entry (trained,
  dropped with a reason, or inside an operator_skip range); ``offsets_accounted_twice``: in more than one.
- ``prompts_lost``: a fed group id (a PromptTask on ``prompts``) with no ScoredGroup on ``groups`` and no dead
  letter of its own (a prompt, completion or group record of that id in the dlq).

Dead letters are counted once per source record (``grpo_core.kafka_io.dead_letter_key``: a record dead-lettered
again after a replay is the same one); ``dead_repeats`` says how many extra copies the dlq holds.

Beside the promises, the learner's incarnations (``grpo_stream.versions``): its restarts, and the version numbers
announced again after one (a restart from a checkpoint older than versions it announced), so a reader knows that
such a version names more than one set of weights.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.contract import PipelineContract
from grpo_core.jsonl import read_lines
from grpo_core.kafka_io import Record, read_topic
from grpo_learner.checkpoint import load_latest
from grpo_stream.versions import describe_again, read_incarnations


@dataclass
class Audit:
    """The reconciliation's figures (``format_audit`` names each); the promises are in :meth:`broken`."""

    fed: int = 0
    produced: int = 0
    groups_records: int = 0
    trained: int = 0
    trained_twice: int = 0
    learner_step: int = 0
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    dead: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_repeats: int = 0
    offsets_accounted: int = 0
    offsets_unaccounted: int = 0
    offsets_accounted_twice: int = 0
    offsets_pending: int = 0
    prompts_lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    incarnations: list[int] = field(default_factory=list)  # the learner's, with lines in the lineage
    restarts: int | None = None  # None: the run records no incarnations
    announced_again: dict[int, list[int]] | None = None  # version -> incarnations; None: no versions.jsonl
    announced_other_weights: int = 0  # of those, versions announced with more than one sha256

    def broken(self) -> list[str]:
        """The promises this run broke (empty: it kept them all)."""
        checks = {"trained_twice": self.trained_twice, "offsets_unaccounted": self.offsets_unaccounted,
                  "offsets_accounted_twice": self.offsets_accounted_twice, "prompts_lost": self.prompts_lost}
        return [f"{k} = {v}" for k, v in checks.items() if v]


def _ids(records: list[Record], cls: type[wire.PromptTask] | type[wire.ScoredGroup]) -> list[str]:
    out = []
    for m in records:
        try:
            out.append(cast("wire.PromptTask | wire.ScoredGroup", wire.decode(m.value, cls)).group_id)
        except wire.WireError:
            continue  # junk on the topic: its dead letter is counted below
    return out


def _dead_letters(records: list[Record], contract: PipelineContract) -> tuple[collections.Counter[str], int, set[str]]:
    """(unique dead letters by 'topic-key: reason kind', repeats, group ids the dead letters name)."""
    names = {contract.topic(k): k for k in ("prompts", "completions", "groups")}
    seen: set[tuple[str, int, int]] = set()
    counts: collections.Counter[str] = collections.Counter()
    repeats, named = 0, set()
    for m in records:
        letter = wire.decode(m.value, wire.DeadLetter)
        where = (letter.source_topic, letter.partition, letter.offset)
        if where in seen:
            repeats += 1
            continue
        seen.add(where)
        counts[f"{names.get(letter.source_topic, letter.source_topic)}: {letter.reason.split(':', 1)[0]}"] += 1
        for cls in (wire.PromptTask, wire.Completion, wire.ScoredGroup):
            try:
                named.add(wire.decode(letter.raw, cls).group_id)  # type: ignore[attr-defined]
                break
            except wire.WireError:
                continue
    return counts, repeats, named


def _checkpointed_lineage(out_dir: Path) -> tuple[int, dict[int, int], list[dict[str, Any]]]:
    """(step, next offset per partition, lineage lines up to that step) of the learner's newest checkpoint."""
    ckpt = load_latest(out_dir / "checkpoints")
    if ckpt is None:
        return 0, {}, []
    lines = [line for line in read_lines(out_dir / "lineage.jsonl") if line["step"] <= ckpt.step]
    return ckpt.step, {int(p): int(o) for p, o in ckpt.meta["offsets"].items()}, lines


def offset_hits(lines: Iterable[dict[str, Any]]) -> collections.Counter[tuple[int, int]]:
    """How often each ``(partition, offset)`` of ``groups`` appears in lineage ``lines``: trained, dropped with a
    reason, or inside an operator_skip range (exactly once, when the promise holds)."""
    hits: collections.Counter[tuple[int, int]] = collections.Counter()
    for line in lines:
        for e in (*line["trained"], *line["dropped"]):
            hits[(e["partition"], e["offset"])] += 1
        for r in line.get("operator_skip", []):
            for o in range(r["from"], r["to"]):
                hits[(r["partition"], o)] += 1
    return hits


def _account(audit: Audit, lines: list[dict[str, Any]], position: dict[int, int], ends: dict[int, int]) -> None:
    hits = offset_hits(lines)
    trained = collections.Counter(e["group_id"] for line in lines for e in line["trained"])
    audit.dropped.update(e["reason"].split(":", 1)[0] for line in lines for e in line["dropped"])
    audit.trained, audit.trained_twice = len(trained), sum(1 for n in trained.values() if n > 1)
    for p, end in ends.items():
        below = position.get(p, 0)
        counts = [hits[(p, o)] for o in range(below)]
        audit.offsets_accounted += sum(1 for n in counts if n == 1)
        audit.offsets_unaccounted += sum(1 for n in counts if n == 0)
        audit.offsets_accounted_twice += sum(1 for n in counts if n > 1)
        audit.offsets_pending += max(0, end - below)


def add_incarnations(a: Audit, out_dir: Path) -> Audit:
    """Fill in ``a``'s incarnation figures from ``out_dir`` (no broker needed); they are no promise: a restart
    that announces versions again keeps exactly-once, it only makes a version number ambiguous."""
    found = read_incarnations(out_dir)
    a.incarnations, a.restarts = found.in_lineage, found.restarts
    a.announced_again = found.again() if found.recorded else None
    a.announced_other_weights = len(found.other_weights())
    return a


def audit_run(kafka: KafkaConfig, contract: PipelineContract, out_dir: Path) -> Audit:
    """Reconcile the run in ``out_dir`` (the learner's out_dir) against its topics on ``kafka``."""
    a = Audit()
    fed = set(_ids(read_topic(kafka, contract.topic("prompts")), wire.PromptTask))
    groups = read_topic(kafka, contract.topic("groups"))
    produced = _ids(groups, wire.ScoredGroup)
    a.fed, a.produced, a.groups_records = len(fed), len(set(produced)), len(groups)
    a.dead, a.dead_repeats, named = _dead_letters(read_topic(kafka, contract.topic("dlq")), contract)
    lost = sorted(fed - set(produced) - named)
    a.prompts_lost, a.lost_ids = len(lost), lost[:20]
    ends: dict[int, int] = collections.defaultdict(int)
    for m in groups:
        ends[m.partition] = max(ends[m.partition], m.offset + 1)
    a.learner_step, position, lines = _checkpointed_lineage(out_dir)
    for p in position:
        ends.setdefault(p, 0)
    _account(a, lines, position, dict(ends))
    return add_incarnations(a, out_dir)


def format_audit(a: Audit, processes: dict[str, str] | None = None) -> str:
    """The reconciliation as a text table (what ``grpo-stream chaos`` prints; docs/concepts.md shows one)."""
    rows: list[tuple[str, Any]] = [
        ("prompts fed (group ids)", a.fed), ("groups produced (distinct)", a.produced),
        ("groups records (incl. re-published)", a.groups_records), ("learner step (checkpoint)", a.learner_step),
        ("groups trained", a.trained), ("trained twice", a.trained_twice),
        ("groups offsets accounted once", a.offsets_accounted), ("groups offsets unaccounted", a.offsets_unaccounted),
        ("groups offsets accounted twice", a.offsets_accounted_twice),
        ("groups offsets not yet read", a.offsets_pending), ("prompts lost", a.prompts_lost),
    ]
    if a.incarnations:
        rows.append(("learner incarnations in the lineage", f"{len(a.incarnations)} "
                     f"({', '.join(map(str, a.incarnations))})"))
    if a.restarts is not None:
        rows.append(("learner restarts", a.restarts))
    if a.announced_again is not None:
        rows.append(("versions announced again after a restart", describe_again(a.announced_again) or "none"))
        rows.append(("versions announced with other weights", a.announced_other_weights))
    rows += [(f"dropped: {k}", v) for k, v in sorted(a.dropped.items())]
    rows += [(f"dead-lettered: {k}", v) for k, v in sorted(a.dead.items())]
    rows.append(("dead letters repeated (same source record)", a.dead_repeats))
    rows += [(f"process {k}", v) for k, v in sorted((processes or {}).items())]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
