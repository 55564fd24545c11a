"""``grpo-stream replay RUN_DIR [--ablation] [key=value ...]``: train a fresh learner on a run's recorded groups.

No generation: the samples are the ``groups`` topic's records, read back through the lineage (the run's own
broker is started again for it, see :mod:`grpo_stream.inspect_run`).

* **exact** (the default): the lineage step by step -- the same groups in the same batches, in the same order --
  from the run's initial weights and seed, under the run's own learner config. Each step's loss is compared
  with the one the run recorded: the tool for a loss spike at step N. It takes no overrides (other settings
  would not reproduce anything: that is an ablation).
* **ablation** (``--ablation key=value ...``): every group the run trained, in the order it was trained,
  re-batched under another learner config (loss variant, clip ranges, beta, i, zero-variance handling, lr,
  ``groups_per_batch``), so loss variants are compared on exactly the same samples. The behaviour logprobs are
  on the records, so the off-policy ratios stay valid.

What replay cannot change: generation (the samples, their behaviour logprobs and rewards are the recorded
ones), v and the producers' settings, hence each sample's policy version and staleness (the lineage's, kept in
the replay's lineage); groups the run dropped stay out. The output is a run directory of its own
(``metrics.jsonl``, ``lineage.jsonl``, ``report.png``, ``replay.json``); ``grpo-stream report --compare`` overlays
it with the original.

Retention: a replayable run needs ``groups`` (and, for ``inspect --group``, ``prompts`` and ``completions``) kept
for as long as it may be replayed: ``retention.ms: -1`` in the topic plan, or a size that holds the run. A
lineage entry whose record is gone is named with its partition and offsets, and nothing is trained.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_core import wire
from grpo_core.config import load_config
from grpo_core.jsonl import read_lines
from grpo_core.stats import is_zero_variance
from grpo_learner.config import LearnerConfig
from grpo_learner.lineage import Lineage
from grpo_learner.metrics import LearnerMetrics
from grpo_learner.service import load_model
from grpo_learner.trainer import Trainer
from grpo_stream.inspect_run import RunLog
from grpo_stream.report import write_report


@dataclass
class Batch:
    groups: list[wire.ScoredGroup]
    entries: list[dict[str, Any]]  # the lineage entries of the groups (partition, offset, id, version, staleness)
    dropped: list[dict[str, Any]]
    original_step: int | None = None  # exact: the run's step this batch reproduces


def training_lines(log: RunLog) -> list[dict[str, Any]]:
    """The run's steps in order (operator_skip and no_update lines trained nothing)."""
    return sorted((line for line in log.lineage if line["trained"]), key=lambda line: line["step"])


def _group(log: RunLog, entry: dict[str, Any]) -> wire.ScoredGroup:
    found = log.groups.get((entry["partition"], entry["offset"]))
    if found is None or found[1] is None:
        raise KeyError((entry["partition"], entry["offset"]))
    return found[1]


def check_retained(log: RunLog, lines: list[dict[str, Any]], topic: str) -> None:
    """Refuse (naming them) when trained records are gone from the log: trimmed by retention."""
    gone: dict[int, list[int]] = {}
    for line in lines:
        for e in line["trained"]:
            if (e["partition"], e["offset"]) not in log.groups:
                gone.setdefault(e["partition"], []).append(e["offset"])
    if gone:
        where = "; ".join(f"partition {p}: offsets {min(o)}-{max(o)} ({len(o)} records)"
                          for p, o in sorted(gone.items()))
        raise SystemExit(f"replay: records the run trained are no longer in {topic} ({where}): the log was "
                         "trimmed by retention; a replayable run needs its groups topic kept (retention.ms: -1)")


def exact_batches(log: RunLog) -> list[Batch]:
    return [Batch([_group(log, e) for e in line["trained"]], line["trained"], [], line["step"])
            for line in training_lines(log)]


def ablation_batches(log: RunLog, cfg: LearnerConfig) -> list[Batch]:
    """Every trained group in the order trained, re-batched by ``groups_per_batch``; zero-variance groups are
    dropped with the learner's reason when the ablation says ``advantages.zero_variance: drop``."""
    items = [(e, _group(log, e)) for line in training_lines(log) for e in line["trained"]]
    drop = cfg.advantages.zero_variance == "drop"
    kept = [(e, g) for e, g in items if not (drop and is_zero_variance(g.rewards))]
    dropped = [e | {"reason": "zero_variance"} for e, g in items if drop and is_zero_variance(g.rewards)]
    n = cfg.groups_per_batch
    batches = [Batch([g for _, g in kept[i:i + n]], [e for e, _ in kept[i:i + n]], [])
               for i in range(0, len(kept), n)]
    if batches:
        batches[0].dropped = dropped  # recorded once, with the first step
    return batches


def replay(run_dir: Path, out: Path, overrides: list[str], ablation: bool) -> dict[str, Any]:
    if overrides and not ablation:
        raise SystemExit("replay: an exact replay reproduces the run and takes no overrides; "
                         "use --ablation to train the same groups under other settings")
    cfg = load_config(LearnerConfig, str(run_dir / "configs" / "learner.yaml"), [f"out_dir={out}", *overrides])
    log = RunLog.read(run_dir, topics=("groups",))
    lines = training_lines(log)
    check_retained(log, lines, cfg.pipeline.topic("groups"))
    batches = ablation_batches(log, cfg) if ablation else exact_batches(log)
    recorded = {m["step"]: m for m in read_lines(run_dir / "metrics.jsonl")}  # after a restart: the survivor
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg, load_model(cfg.model))
    metrics, lineage = LearnerMetrics(out / "metrics.jsonl"), Lineage(out / "lineage.jsonl")
    diffs: list[dict[str, Any]] = []
    for step, batch in enumerate(batches, start=1):
        stats = trainer.train_step(batch.groups)
        if cfg.stage_steps and step % cfg.stage_steps == 0:
            trainer.reset_reference()
        lineage.record(step, batch.entries, batch.dropped, skipped_updates=stats.skipped_updates,
                       **({"original_step": batch.original_step} if batch.original_step is not None else {}))
        metrics.observe_step(step, stats.metrics, stats.timings, staleness=[e["staleness"] for e in batch.entries],
                             dropped=[e["reason"] for e in batch.dropped], tokens=stats.tokens,
                             skipped=stats.skipped_updates, lag=0)
        if not ablation and batch.original_step in recorded:
            was, now = recorded[batch.original_step].get("loss"), stats.metrics.get("loss")
            if was is not None and now is not None:
                diffs.append({"step": step, "recorded": was, "replayed": now, "abs_diff": abs(now - was)})
    lineage.close()
    metrics.close()
    write_report(out)
    result = {"mode": "ablation" if ablation else "exact", "run": str(run_dir), "steps": len(batches),
              "groups": sum(len(b.groups) for b in batches), "overrides": overrides,
              "max_abs_loss_diff": max((d["abs_diff"] for d in diffs), default=None), "loss_diffs": diffs}
    (out / "replay.json").write_text(json.dumps(result, indent=2))
    return result


def main(run_dir: str, out: str | None, overrides: list[str], ablation: bool) -> int:
    root = Path(run_dir)
    if not (root / "lineage.jsonl").exists() or not (root / "configs" / "learner.yaml").exists():
        raise SystemExit(f"replay: {root} is not a run directory (no lineage.jsonl and configs/learner.yaml)")
    dest = Path(out) if out else root.parent / f"{root.name}-replay{'-ablation' if ablation else ''}"
    r = replay(root, dest, overrides, ablation)
    worst = r["max_abs_loss_diff"]
    print(f"replay ({r['mode']}): {r['steps']} steps, {r['groups']} groups -> {dest}"
          + ("" if worst is None or not math.isfinite(worst) else f"; max |loss - recorded loss| {worst:.3g}"))
    return 0
