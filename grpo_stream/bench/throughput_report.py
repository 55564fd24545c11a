"""``bench throughput``'s report: per arm the median and spread over the repeats, ratios to S, S-hybrid and TRL,
the ideal ratio from S's phase times, CPUs by role, the targets' verdicts, and ``throughput.json`` /
``throughput.png``. Pure functions of the arms' results (:mod:`grpo_stream.bench.throughput` runs them)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_stream.bench.cpu_use import STEAL_WARN, format_cpus

if TYPE_CHECKING:
    from grpo_producers.backends.lengths import LengthsConfig
    from grpo_stream.bench.throughput import Plan

# Printed per arm (median, then min/max over the repeats).
FIELDS = ("steps_per_s", "generated_completions_per_s", "generated_tokens_per_s", "trained_tokens_per_s",
          "engine_busy", "learner_busy", "staleness", "steps_measured")
# The targets for the preset scenario (best pipeline arm) and the demo scenario (P demo against TRL).
TARGETS = {"S": 1.6, "S-hybrid": 1.2, "TRL": 1.3}
IDEAL_SHARE = 0.85  # the best pipeline arm within 15% of the ideal ratio
DEMO_TRL_TARGET = 0.5
TRL_UNMATCHED = ("TRL generates with HF generate (its vLLM modes need CUDA vLLM): every batch pads to its longest "
                 "completion; its dual clip is `delta` (the ratio capped at c for every token) where the learner "
                 "bounds only negative-advantage terms; it runs as one process on both CPUs; drawn lengths reach it "
                 "as a logits processor that forces EOS at each row's length (one token more than the pipeline's "
                 "samples, which end without EOS).")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per arm, per numeric field present in every repeat: median, min and max over the repeats."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm, runs in results.items():
        keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
        out[arm] = {k: spread([float(r[k]) for r in runs if isinstance(r.get(k), int | float)])
                    for k in keys if all(isinstance(r.get(k), int | float) for r in runs)}
    return out


def ideal_ratio(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, float] | None:
    """From S's median phases per step: a pipeline that overlaps them perfectly steps every max(gen, train)
    instead of every gen + train."""
    s = summary.get("S")
    if not s or "gen_s_per_step" not in s:
        return None
    gen, train = s["gen_s_per_step"]["median"], s["train_s_per_step"]["median"]
    return {"gen_s": gen, "train_s": train, "ratio": (gen + train) / max(gen, train, 1e-9)}


def ratios(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each arm's median steps/s over each reference arm's (S, S-hybrid, TRL), where both ran."""
    rate = {arm: s["steps_per_s"]["median"] for arm, s in summary.items() if "steps_per_s" in s}
    return {arm: {ref: r / rate[ref] for ref in ("S", "S-hybrid", "TRL") if rate.get(ref)} for arm, r in rate.items()}


def verdicts(plan: Plan, summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """The targets, met or missed, with the measured figure."""
    rel, ideal = ratios(summary), ideal_ratio(summary)
    if plan.scenario.demo:
        got = rel.get("P demo", {}).get("TRL")
        if got is None:
            return []
        met = "MET" if got >= DEMO_TRL_TARGET else "MISSED"
        return [f"P demo / TRL = {got:.2f} (target >= {DEMO_TRL_TARGET}): {met}"]
    pipes = [a for a in rel if a.startswith("P ")]
    if not pipes:
        return []
    best = max(pipes, key=lambda a: summary[a]["steps_per_s"]["median"])
    lines = [f"best pipeline arm: {best}"]
    for ref, target in TARGETS.items():
        if ref in rel[best]:
            got = rel[best][ref]
            lines.append(f"  {best} / {ref} = {got:.2f} (target >= {target}): {'MET' if got >= target else 'MISSED'}")
    if ideal and "S" in rel[best]:
        share = rel[best]["S"] / ideal["ratio"]
        lines.append(f"  {best} / S = {share:.2f} of the ideal {ideal['ratio']:.2f} (target >= {IDEAL_SHARE}): "
                     f"{'MET' if share >= IDEAL_SHARE else 'MISSED'}")
    balance = ideal and max(ideal["gen_s"], ideal["train_s"]) / max(min(ideal["gen_s"], ideal["train_s"]), 1e-9)
    if balance:
        lines.append(f"  S's gen/train balance {balance:.2f}x (the targets assume within 1.5x)")
    return lines


def _cell(s: dict[str, float] | None, fmt: str = ".3f") -> str:
    return "-" if s is None else f"{s['median']:{fmt}}"


def _range(s: dict[str, float] | None, fmt: str = ".3f") -> str:
    return "-" if s is None else f"{s['min']:{fmt}}/{s['max']:{fmt}}"


def table(summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    rel = ratios(summary)
    head = ["arm", *FIELDS, "x S", "x S-hybrid", "x TRL"]
    lines = ["  ".join(f"{h:>14}" if i else f"{h:<14}" for i, h in enumerate(head))]
    for arm, s in summary.items():
        cells = [_cell(s.get(k)) for k in FIELDS] + [f"{rel[arm][r]:.3f}" if r in rel.get(arm, {}) else "-"
                                                     for r in ("S", "S-hybrid", "TRL")]
        lines.append("  ".join([f"{arm:<14}", *(f"{c:>14}" for c in cells)]))
        lines.append("  ".join([f"{'  min/max':<14}", *(f"{_range(s.get(k)):>14}" for k in FIELDS)]))
    return lines


def cpu_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """CPUs each role used (median over the repeats) while the arm's window ran, and repeats with steal."""
    lines = []
    for arm, runs in results.items():
        roles = sorted({r for run in runs for r in run.get("cpu_by_role") or {}})
        if roles:
            med = {r: statistics.median([run["cpu_by_role"].get(r, 0.0) for run in runs if run.get("cpu_by_role")])
                   for r in roles}
            lines.append("  " + format_cpus(arm, med))
        for i, run in enumerate(runs):
            if (run.get("cpu_steal") or 0.0) > STEAL_WARN:
                lines.append(f"  {arm} repeat {i + 1}: {run['cpu_steal']:.1%} of a CPU stolen by the host")
    return lines


def describe_lengths(lengths: LengthsConfig) -> str:
    if lengths.dist == "model":
        return "lengths the model's own"
    if lengths.dist == "fixed":
        return f"lengths fixed at {lengths.median}"
    return f"lengths {lengths.dist} (median {lengths.median}, p99 {lengths.p99_ratio}x)"


def report(plan: Plan, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary = summarize(results)
    ideal = ideal_ratio(summary)
    sc = plan.scenario
    lines = [f"bench throughput: {sc.name}, task {sc.task}, G {sc.group_size}, {sc.prompts_per_step} prompts/step, "
             f"{describe_lengths(sc.lengths)}, {plan.repeats} repeat(s), {plan.warmup}+{plan.steps} steps per arm"]
    if ideal:
        lines.append(f"S: gen {ideal['gen_s']:.2f}s + train {ideal['train_s']:.2f}s per step -> ideal ratio "
                     f"{ideal['ratio']:.2f}x S's steps/s")
    lines += table(summary) + ["CPUs by role (median over repeats):", *cpu_lines(results)] + verdicts(plan, summary)
    if "TRL" in results:
        lines.append(f"TRL {results['TRL'][0].get('trl_version', '?')}, not matched: {TRL_UNMATCHED}")
    print("\n".join(lines), flush=True)
    data = {"scenario": asdict(sc), "arms": [a.name for a in plan.arms], "repeats": plan.repeats,
            "warmup": plan.warmup, "steps": plan.steps, "machine": machine(), "command": " ".join(sys.argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "ideal": ideal,
            "ratios": ratios(summary), "verdicts": verdicts(plan, summary), "summary": summary, "results": results}
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "throughput.json").write_text(json.dumps(data, indent=1, default=str))
    figure(summary, ideal, plan.out / "throughput.png", lines[0])
    print(f"[bench throughput] wrote {plan.out / 'throughput.json'} and {plan.out / 'throughput.png'}")
    return data


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version()}


def figure(summary: dict[str, dict[str, dict[str, float]]], ideal: dict[str, float] | None, path: Path,
           title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a, s in summary.items() if "steps_per_s" in s]
    med = [summary[a]["steps_per_s"]["median"] for a in arms]
    err = [[m - summary[a]["steps_per_s"]["min"] for a, m in zip(arms, med, strict=True)],
           [summary[a]["steps_per_s"]["max"] - m for a, m in zip(arms, med, strict=True)]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms)), 4))
    ax.bar(arms, med, yerr=err, capsize=4, color=["#888" if a.startswith(("S", "TRL")) else "#2a7" for a in arms])
    if ideal and "S" in summary:
        ax.axhline(summary["S"]["steps_per_s"]["median"] * ideal["ratio"], ls="--", color="k",
                   label=f"ideal ({ideal['ratio']:.2f}x S)")
        ax.legend()
    ax.set_ylabel("learner steps/s (median, min-max)")
    ax.set_title(textwrap.fill(title, 90), fontsize=8)  # the header names the whole scenario: wrap, not clip
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
