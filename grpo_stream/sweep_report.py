"""The sweep's figure (``sweep.png``) and table (``sweep.md``), from each run's own records.

Per run: ``eval.jsonl`` (held-out reward of each evaluated version: greedy, and Pass@1 over k samples), the
lineage (samples trained by each step; the staleness of every trained group) and ``summary.json``. Per arm, the
mean +- std over its seeds: held-out reward vs learner step, vs samples trained and vs wall-clock (each seed's
curve interpolated onto the union of the seeds' points, held flat past its last one).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from grpo_core.jsonl import read_lines

if TYPE_CHECKING:
    from grpo_stream.sweep import Planned, SweepConfig

AXES = (("step", "learner step"), ("samples", "completions trained"), ("minutes", "wall-clock minutes"))


def run_record(out: Path) -> dict[str, Any]:
    """One run's curves and figures (what the figure and the table need)."""
    summary = json.loads((out / "summary.json").read_text())
    G = int(yaml.safe_load((out / "run-config.yaml").read_text())["pipeline"]["group_size"])
    lineage = list(read_lines(out / "lineage.jsonl"))
    per_step: dict[int, int] = {}
    for line in lineage:
        per_step[line["step"]] = per_step.get(line["step"], 0) + len(line["trained"]) * G
    evals = list(read_lines(out / "eval.jsonl"))

    def samples_at(step: int) -> int:
        return sum(n for s, n in per_step.items() if s <= step)

    staleness = sorted(e["staleness"] for line in lineage for e in line["trained"])
    t0 = evals[0]["time"] if evals else 0.0
    return {
        "step": [e["step"] for e in evals], "samples": [samples_at(e["step"]) for e in evals],
        "minutes": [(e["time"] - t0) / 60 for e in evals], "reward": [e["eval_reward"] for e in evals],
        "pass_at_1": [e.get("pass_at_1") for e in evals], "final": summary["final_eval_reward"],
        "pushes": summary["weight_versions_published"], "steps": summary["learner_steps"],
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_p95": staleness[int(0.95 * (len(staleness) - 1))] if staleness else 0,
        "dropped": summary["groups_dropped_stale"] + summary["groups_dropped_other"],
        "wall_s": summary["wall_seconds"],
    }


def to_target(rec: dict[str, Any], target: float, axis: str) -> float | None:
    """The first evaluated ``axis`` value (step or samples) whose held-out reward is >= ``target``."""
    return next((x for x, r in zip(rec[axis], rec["reward"], strict=True) if r >= target), None)


def mean_curve(recs: list[dict[str, Any]], axis: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs = np.unique(np.concatenate([np.asarray(r[axis], dtype=float) for r in recs]))
    ys = np.stack([np.interp(xs, r[axis], r["reward"]) for r in recs])
    return xs, ys.mean(axis=0), ys.std(axis=0)


def _pm(values: list[float], fmt: str = ".3f") -> str:
    if not values:
        return "-"
    sd = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):{fmt}} ± {sd:{fmt}}"


def table(by_arm: dict[str, list[dict[str, Any]]], target: float, pass_k: int) -> str:
    head = ["arm", "seeds", "final held-out", "best held-out", f"final Pass@1 (k={pass_k})",
            f"steps to {target}", f"samples to {target}", "weight pushes", "staleness mean", "staleness p95",
            "dropped groups", "wall s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, recs in by_arm.items():
        reached = {a: [v for r in recs if (v := to_target(r, target, a)) is not None] for a in ("step", "samples")}
        passes = [p[-1] for r in recs if (p := [x for x in r["pass_at_1"] if x is not None])]
        cells = [arm, str(len(recs)), _pm([r["final"] for r in recs]), _pm([max(r["reward"]) for r in recs]),
                 _pm(passes), f"{_pm(reached['step'], '.0f')} ({len(reached['step'])}/{len(recs)})",
                 f"{_pm(reached['samples'], '.0f')} ({len(reached['samples'])}/{len(recs)})",
                 _pm([r["pushes"] for r in recs], ".0f"), _pm([r["staleness_mean"] for r in recs], ".2f"),
                 _pm([r["staleness_p95"] for r in recs], ".1f"), _pm([r["dropped"] for r in recs], ".0f"),
                 _pm([r["wall_s"] for r in recs], ".0f")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def figure(by_arm: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (arm, recs) in enumerate(by_arm.items()):
        for ax, (axis, label) in zip(axes, AXES, strict=True):
            xs, mean, sd = mean_curve(recs, axis)
            ax.plot(xs, mean, "o-", ms=3, color=f"C{i}", label=f"{arm} (n={len(recs)})")
            ax.fill_between(xs, mean - sd, mean + sd, color=f"C{i}", alpha=0.15)
            ax.set(xlabel=label, ylim=(-0.02, 1.02))
    for ax in axes:
        ax.axhline(target, color="grey", lw=0.6, ls="--")
    axes[0].set_ylabel("held-out reward (greedy), mean ± std over seeds")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def measures(task: str) -> str:
    """What the table's held-out columns measure: a multi-token task's greedy reward is partial credit, while
    Pass@1 only counts a sample with every digit right, so the two differ far more than on a one-token task."""
    from grpo_stream.demo_model import task_reward

    greedy = ("`positions` reward (partial credit per digit in place)" if task_reward(task) == "positions"
              else "exact match")
    return (f"Held-out: greedy decoding, mean {greedy}. Pass@1: exact match of a sampled answer at the sampling "
            "temperature (every digit right).")


def write(cfg: SweepConfig, runs: list[Planned]) -> tuple[Path, Path]:
    """sweep.md and sweep.png under ``cfg.out_dir`` from the finished runs (unfinished ones are left out)."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.done:
            by_arm.setdefault(r.arm, []).append(run_record(r.out))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "sweep.md", out / "sweep.png"
    missing = [f"{r.arm} seed {r.seed}" for r in runs if not r.done]
    md.write_text(f"# sweep: {cfg.base}, task {cfg.task}{', lockstep' if cfg.lockstep else ''}\n\n"
                  + measures(cfg.task) + "\n\n" + table(by_arm, cfg.target, cfg.eval.pass_k)
                  + (f"\nnot finished: {', '.join(missing)}\n" if missing else ""))
    figure(by_arm, cfg.target, png)
    return md, png
