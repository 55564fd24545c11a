"""``grpo-stream inspect RUN_DIR``: what the learner trained on, read back from the run's lineage and its log.

The lineage (``lineage.jsonl``) says which ``groups`` offsets each learner step trained or dropped and why; the
topics hold the records themselves. A run that had a broker of its own (``RUN_DIR/kafka``) has it started again
on its recorded ports for the reading and stopped afterwards; a run on a cluster is read from the cluster in
its learner config. Views (:func:`main`):

* ``--summary``: per range of steps, groups trained, mean reward and staleness, drops by reason; then the dead
  letters by topic and reason, and the learner's incarnations with the versions announced again after a restart.
* ``--step N``: every group trained at step N -- prompt and completion texts, rewards, advantages (the run's own
  advantage settings), policy versions and span, staleness, producer, topic/partition/offset -- and what the
  step dropped, with the reason; and the learner incarnation that wrote the step's lines.
* ``--group ID``: one group end to end: its prompt record(s), completion records, scored group(s), the step
  that trained it or the reason it was not, and the announcements of its policy versions (a version announced
  again after a learner restart with other weights is ambiguous: the records do not say which weights sampled).

Text tables by default, ``--json`` for scripts.
"""

from __future__ import annotations

import collections
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core import wire
from grpo_core.config import KafkaConfig, load_config
from grpo_core.contract import TopicKey
from grpo_core.jsonl import read_lines
from grpo_core.kafka_io import Record, read_topic
from grpo_learner.advantages import group_advantages
from grpo_learner.config import LearnerConfig
from grpo_stream.broker import LocalBroker
from grpo_stream.versions import Incarnations, describe_again, incarnation_list, read_incarnations

RANGES = 10  # rows of --summary


@contextlib.contextmanager
def run_cluster(run_dir: Path, learner: LearnerConfig) -> Iterator[KafkaConfig]:
    """The cluster holding the run's topics: its own broker, started again on its ports if it is down."""
    state_file = run_dir / "kafka" / "broker.json"
    if not state_file.exists():
        yield learner.kafka
        return
    state = json.loads(state_file.read_text())
    broker = LocalBroker(data_dir=run_dir / "kafka", port=state["port"], controller_port=state["controller_port"])
    started = not broker.status()["running"]
    broker.up()
    try:
        yield KafkaConfig(bootstrap=broker.bootstrap)
    finally:
        if started:
            broker.down()


@dataclass
class RunLog:
    """A run's lineage and records, indexed for the views."""

    learner: LearnerConfig
    lineage: list[dict[str, Any]]
    groups: dict[tuple[int, int], tuple[Record, wire.ScoredGroup | None]] = field(default_factory=dict)
    completions: dict[str, list[tuple[Record, wire.Completion]]] = field(default_factory=dict)
    prompts: dict[str, list[tuple[Record, wire.PromptTask]]] = field(default_factory=dict)
    dead: list[wire.DeadLetter] = field(default_factory=list)
    incarnations: Incarnations = field(default_factory=Incarnations)

    @classmethod
    def read(cls, run_dir: Path, topics: tuple[TopicKey, ...] = ("groups", "completions", "prompts", "dlq")) -> RunLog:
        learner = load_config(LearnerConfig, str(run_dir / "configs" / "learner.yaml"), [])
        log = cls(learner, list(read_lines(run_dir / "lineage.jsonl")))
        log.incarnations = read_incarnations(run_dir, log.lineage)
        plan = learner.pipeline
        with run_cluster(run_dir, learner) as kafka:
            records = {t: read_topic(kafka, plan.topic(t)) for t in topics}
        for m in records.get("groups", []):
            log.groups[(m.partition, m.offset)] = (m, _decoded(m, wire.ScoredGroup))
        for m in records.get("completions", []):
            if (c := _decoded(m, wire.Completion)) is not None:
                log.completions.setdefault(c.group_id, []).append((m, c))
        for m in records.get("prompts", []):
            if (t := _decoded(m, wire.PromptTask)) is not None:
                log.prompts.setdefault(t.prompt_id, []).append((m, t))
        log.dead = [d for m in records.get("dlq", []) if (d := _decoded(m, wire.DeadLetter))]
        return log

    def lines(self, step: int) -> list[dict[str, Any]]:
        """Every lineage line of ``step``: its training line and the ``no_update`` lines after it, which drop
        groups at the same step number (nothing trainable was left to take them)."""
        found = [line for line in self.lineage if line["step"] == step]
        if found:
            return found
        steps = [line["step"] for line in self.lineage]
        raise SystemExit(f"inspect: no learner step {step} in the lineage (steps {min(steps, default=0)}-"
                         f"{max(steps, default=0)})")


def _decoded(m: Record, cls: type[wire.R]) -> wire.R | None:
    try:
        return wire.decode(m.value, cls)
    except wire.WireError:
        return None  # junk on the topic: its dead letter tells why


def _coords(m: Record) -> str:
    return f"{m.topic}/{m.partition}/{m.offset}"


def _spans(c: wire.Completion) -> list[list[int]]:
    """[[version, first token], ...]: more than one when generation continued across a weight swap."""
    return [[c.policy_version, 0], *([v, s] for v, s in zip(c.later_versions, c.later_starts, strict=True))]


def group_view(log: RunLog, entry: dict[str, Any]) -> dict[str, Any]:
    """One group as a lineage entry names it, with its record from the groups topic."""
    view: dict[str, Any] = dict(entry)
    found = log.groups.get((entry["partition"], entry["offset"]))
    if found is None:
        view["missing"] = "not in the groups topic (trimmed by retention?)"
        return view
    msg, g = found
    view["coordinates"] = _coords(msg)
    if g is None:
        return view | {"undecodable": True}
    adv = group_advantages(g.rewards, log.learner.advantages, log.learner.pipeline.stats_eps).tolist()
    first = g.completions[0]
    view.update(prompt_id=g.prompt_id, task=g.task, prompt=first.prompt, verifier=g.verifier_id,
                reward_mean=g.reward_mean, reward_std=g.reward_std, completions=[
                    {"index": c.index, "completion": c.completion, "reward": r, "advantage": a,
                     "tokens": len(c.completion_token_ids), "finish": c.finish_reason, "spans": _spans(c),
                     "producer": c.producer_id}
                    for c, r, a in zip(g.completions, g.rewards, adv, strict=True)])
    return view


def step_view(log: RunLog, step: int) -> dict[str, Any]:
    """A step's groups, and the incarnation(s) that wrote its lines (a restarted learner may add a no_update line
    at the step its predecessor checkpointed)."""
    lines = log.lines(step)
    return {"step": step, "incarnations": sorted({line["incarnation"] for line in lines if "incarnation" in line}),
            "trained": [group_view(log, e) for line in lines for e in line["trained"]],
            "dropped": [group_view(log, e) for line in lines for e in line["dropped"]]}


def version_weights(log: RunLog, versions: set[int]) -> list[dict[str, Any]]:
    """Which announcements (incarnation, sha256) each of ``versions`` has in versions.jsonl; empty for a run
    without one. More than one set of weights under a version: ``ambiguous`` says so."""
    if not log.incarnations.recorded:
        return []
    out = []
    for v in sorted(versions):
        found = log.incarnations.of(v)
        item: dict[str, Any] = {"version": v, "announcements": [
            {"incarnation": a["incarnation"], "sha256": a["sha256"][:12]} for a in found]}
        if len({a["sha256"] for a in found}) > 1:
            incs = sorted({a["incarnation"] for a in found})
            item["ambiguous"] = f"announced by incarnations {incarnation_list(incs)}"
        out.append(item)
    return out


def group_trace(log: RunLog, group_id: str) -> dict[str, Any]:
    """A group end to end: prompt -> completions -> scored group -> the step that trained (or dropped) it, and
    the announced weights of the versions that sampled it."""
    scored = [(m, g) for m, g in log.groups.values() if g is not None and g.group_id == group_id]
    prompt_id = scored[0][1].prompt_id if scored else group_id.split("@", 1)[0]
    outcome = [{"step": line["step"], "trained": e in line["trained"], **e,
                **({"incarnation": line["incarnation"]} if "incarnation" in line else {})}
               for line in log.lineage for e in (*line["trained"], *line["dropped"]) if e.get("group_id") == group_id]
    versions = {g.policy_version for _, g in scored} | {e["version"] for e in outcome if "version" in e}
    versions |= {v for _, c in log.completions.get(group_id, []) for v, _ in _spans(c)}
    return {
        "group_id": group_id,
        "prompts": [{"coordinates": _coords(m), "prompt": t.prompt, "epoch": t.epoch, "sample_round": t.sample_round}
                    for m, t in log.prompts.get(prompt_id, []) if t.group_id == group_id],
        "completions": [{"coordinates": _coords(m), "index": c.index, "producer": c.producer_id,
                         "attempt": c.metadata.get("attempt"), "spans": _spans(c), "completion": c.completion}
                        for m, c in log.completions.get(group_id, [])],
        "scored": [{"coordinates": _coords(m), "rewards": g.rewards, "verifier": g.verifier_id,
                    "policy_version": g.policy_version} for m, g in scored],
        "outcome": outcome or [{"trained": False, "reason": "in no lineage entry: not consumed yet (or not "
                                                            "scored: see the prompts and the dead letters)"}],
        "dead_letters": [{"source": f"{d.source_topic}/{d.partition}/{d.offset}", "reason": d.reason}
                         for d in log.dead if group_id.encode() in d.raw],
        "weights": version_weights(log, versions),
    }


def summary(log: RunLog) -> dict[str, Any]:
    lines = log.lineage
    size = max(1, -(-len(lines) // RANGES))
    rows = []
    for chunk in (lines[i:i + size] for i in range(0, len(lines), size)):
        trained = [e for line in chunk for e in line["trained"]]
        rewards = [g.reward_mean for e in trained if (found := log.groups.get((e["partition"], e["offset"])))
                   and (g := found[1]) is not None]
        rows.append({"steps": f"{chunk[0]['step']}-{chunk[-1]['step']}", "trained": len(trained),
                     "reward": statistics.fmean(rewards) if rewards else None,
                     "staleness": statistics.fmean(e["staleness"] for e in trained) if trained else None,
                     "dropped": dict(collections.Counter(e["reason"].split(":", 1)[0]
                                                         for line in chunk for e in line["dropped"]))})
    dead = collections.Counter(f"{d.source_topic}: {d.reason.split(':', 1)[0]}" for d in log.dead)
    steps = sum(1 for line in lines if line["trained"])  # no operator_skip, no no_update lines
    inc = log.incarnations
    return {"steps": steps, "ranges": rows, "dead_letters": dict(sorted(dead.items())),
            "incarnations": inc.in_lineage, "restarts": inc.restarts,
            "announced_again": inc.again() if inc.recorded else None,
            "announced_other_weights": inc.other_weights() if inc.recorded else None}


# ------------------------------------------------------------------------------------------ text


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def format_summary(s: dict[str, Any]) -> str:
    out = [f"{s['steps']} learner steps", f"{'steps':>11} {'trained':>8} {'reward':>8} {'staleness':>10}  dropped"]
    for r in s["ranges"]:
        drops = ", ".join(f"{k} {n}" for k, n in r["dropped"].items()) or "-"
        out.append(f"{r['steps']:>11} {r['trained']:>8} {_num(r['reward']):>8} {_num(r['staleness']):>10}  {drops}")
    out.append("dead letters: " + (", ".join(f"{k} x{n}" for k, n in s["dead_letters"].items()) or "none"))
    if s.get("incarnations"):
        out.append(f"learner incarnations in the lineage: {', '.join(map(str, s['incarnations']))}"
                   + ("" if s.get("restarts") is None else f" (restarts {s['restarts']})"))
    if s.get("announced_again") is not None:
        again = describe_again(s["announced_again"]) or "none"
        other = s["announced_other_weights"]
        out.append(f"versions announced again after a restart: {again}"
                   + (f"; with other weights: {', '.join(f'v{v}' for v in other)}" if other else ""))
    return "\n".join(out)


def format_group(g: dict[str, Any]) -> str:
    head = (f"{g['group_id']} v{g.get('version')} staleness {g.get('staleness')} at "
            f"{g.get('coordinates', '?')}" + (f" DROPPED: {g['reason']}" if "reason" in g else ""))
    if "completions" not in g:
        return head + "".join(f"\n  {k}: {g[k]}" for k in ("missing", "undecodable") if k in g)
    out = [head, f"  prompt {g['prompt_id']!r} ({g['task']}): {g['prompt']!r}  reward mean {_num(g['reward_mean'])}"]
    for c in g["completions"]:
        out.append(f"  [{c['index']}] reward {_num(c['reward'])} adv {c['advantage']:+.3f} {c['tokens']} tok "
                   f"{c['finish']} spans {c['spans']} {c['producer']}: {c['completion']!r}")
    return "\n".join(out)


def format_step(v: dict[str, Any]) -> str:
    incs = v.get("incarnations") or []
    by = f" (incarnation{'s' if len(incs) > 1 else ''} {incarnation_list(incs)})" if incs else ""
    out = [f"step {v['step']}: {len(v['trained'])} trained, {len(v['dropped'])} dropped{by}"]
    out += [format_group(g) for g in (*v["trained"], *v["dropped"])]
    return "\n".join(out)


def format_weights(w: dict[str, Any]) -> str:
    """``v12: i0 sha256 0123456789ab, i1 sha256 ba9876543210  AMBIGUOUS: announced by incarnations 0 and 1``."""
    found = ", ".join(f"i{a['incarnation']} sha256 {a['sha256']}" for a in w["announcements"]) or "not announced"
    return f"v{w['version']}: {found}" + (f"  AMBIGUOUS: {w['ambiguous']}" if "ambiguous" in w else "")


def format_trace(t: dict[str, Any]) -> str:
    out = [f"group {t['group_id']}"]
    for key in ("prompts", "completions", "scored", "outcome", "dead_letters"):
        out.append(f"  {key}:" + ("" if t[key] else " none"))
        out += [f"    {json.dumps(item, default=str)}" for item in t[key]]
    if t.get("weights"):
        out.append("  weights (versions.jsonl):")
        out += [f"    {format_weights(w)}" for w in t["weights"]]
    return "\n".join(out)


def main(run_dir: str, step: int | None = None, group: str | None = None, as_json: bool = False) -> int:
    root = Path(run_dir)
    if not (root / "lineage.jsonl").exists() or not (root / "configs" / "learner.yaml").exists():
        raise SystemExit(f"inspect: {root} is not a run directory (no lineage.jsonl and configs/learner.yaml)")
    log = RunLog.read(root)
    text: Callable[[dict[str, Any]], str]
    if step is not None:
        view, text = step_view(log, step), format_step
    elif group is not None:
        view, text = group_trace(log, group), format_trace
    else:
        view, text = summary(log), format_summary
    print(json.dumps(view, indent=2, default=str) if as_json else text(view))
    return 0
