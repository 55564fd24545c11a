"""``bench publish``'s report: per preset and arm the median (min/max) of the repeats, the ratio to ``none``, the
target's verdict (async <= 1.10x none), the extrapolation to 7B and 32B from the measured rates, and
``publish.json`` / ``publish.png``. Pure functions of the arms' results (:mod:`grpo_stream.bench.saving_cost`)."""

from __future__ import annotations

import datetime
import json
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_stream.bench.throughput_report import machine, summarize

if TYPE_CHECKING:
    from grpo_stream.bench.saving_cost import Plan

TARGET = 1.10  # async step time / none step time
# Every field an arm's result carries (None where the arm does not save), in the JSON and printed.
FIELDS = ("step_s", "train_s", "save_s", "drain_s", "publishes", "checkpoints", "publish_learner_s",
          "publish_wait_s", "publish_snapshot_s", "publish_write_s", "publish_bytes", "checkpoint_learner_s",
          "checkpoint_wait_s", "checkpoint_snapshot_s", "checkpoint_write_s", "checkpoint_bytes", "store_files",
          "versions_recorded", "announced_highest")
# Printed per arm, a table per section: (field, header, format); bytes in MB (1e6).
SECTIONS = {
    "step loop": (("step_s", "step s", ".3f"), ("x_none", "x none", ".2f"), ("train_s", "train s", ".3f"),
                  ("save_s", "save s", ".3f"), ("drain_s", "drain s", ".3f")),
    "per publish": (("publish_learner_s", "loop s", ".3f"), ("publish_wait_s", "wait s", ".3f"),
                    ("publish_snapshot_s", "snapshot s", ".3f"), ("publish_write_s", "write s", ".3f"),
                    ("publish_bytes", "MB", ".1f")),
    "per checkpoint": (("checkpoint_learner_s", "loop s", ".3f"), ("checkpoint_wait_s", "wait s", ".3f"),
                       ("checkpoint_snapshot_s", "snapshot s", ".3f"), ("checkpoint_write_s", "write s", ".3f"),
                       ("checkpoint_bytes", "MB", ".1f")),
    "written": (
        ("publishes", "publishes", ".0f"), ("checkpoints", "checkpoints", ".0f"), ("store_files", "store files", ".0f"),
        ("versions_recorded", "versions.jsonl", ".0f"), ("announced_highest", "announced v", ".0f")),
}
# (name, published GB in bf16, parameters): the checkpoint holds fp32 master weights + AdamW's two moments.
BIG = (("7B", 15.2, 7.6e9), ("32B", 65.0, 32.5e9))
CKPT_BYTES_PER_PARAM = 3 * 4


def ratios(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Each arm's median step time over ``none``'s."""
    base = summary.get("none", {}).get("step_s", {}).get("median")
    return {arm: s["step_s"]["median"] / base for arm, s in summary.items() if base and "step_s" in s}


def verdict(rel: dict[str, float]) -> str:
    if "async" not in rel:
        return "async vs none: not measured (both arms are needed)"
    met = "MET" if rel["async"] <= TARGET else "MISSED"
    return f"async step time = {rel['async']:.2f}x none (target <= {TARGET:.2f}x): {met}"


def _cell(summary: dict[str, dict[str, float]], key: str, fmt: str, rel: float | None) -> tuple[str, str]:
    if key == "x_none":
        return ("-" if rel is None else f"{rel:.2f}"), ""
    s = summary.get(key)
    if s is None:
        return "-", ""
    scale = 1e-6 if key.endswith("_bytes") else 1.0
    return f"{s['median'] * scale:{fmt}}", f"{s['min'] * scale:{fmt}}/{s['max'] * scale:{fmt}}"


def table(summary: dict[str, dict[str, dict[str, float]]], repeats: int) -> list[str]:
    """The medians over the repeats; their min/max below each arm when there were several."""
    rel, lines, width = ratios(summary), [], 16
    for section, columns in SECTIONS.items():
        lines.append(f"  {section + ':':<24}" + "".join(f"{h:>{width}}" for _, h, _ in columns))
        for arm, s in summary.items():
            cells = [_cell(s, key, fmt, rel.get(arm)) for key, _, fmt in columns]
            lines.append(f"    {arm:<22}" + "".join(f"{c:>{width}}" for c, _ in cells))
            if repeats > 1 and any(r for _, r in cells):
                lines.append(f"    {'  min/max':<22}" + "".join(f"{r:>{width}}" for _, r in cells))
    return lines


def _median(summary: dict[str, dict[str, dict[str, float]]], arm: str, key: str) -> float | None:
    s = summary.get(arm, {}).get(key)
    return s["median"] if s else None


def rates(summary: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Seconds per GB, measured: writes from the sync arm (nothing else running; async's when sync did not run),
    snapshots from the async arm."""
    out = {}
    for kind in ("publish", "checkpoint"):
        gb = (_median(summary, "sync", f"{kind}_bytes") or _median(summary, "async", f"{kind}_bytes") or 0) / 1e9
        write = _median(summary, "sync", f"{kind}_write_s") or _median(summary, "async", f"{kind}_write_s")
        snap = _median(summary, "async", f"{kind}_snapshot_s")
        if gb > 0 and write is not None:
            out[f"{kind}_write_s_per_gb"] = write / gb
        if gb > 0 and snap is not None:
            out[f"{kind}_snapshot_s_per_gb"] = snap / gb
    return out


def extrapolate(preset: str, summary: dict[str, dict[str, dict[str, float]]],
                every: int) -> dict[str, Any]:
    """The measured row of ``preset`` and 7B / 32B from its rates (arithmetic: size x s/GB)."""
    r = rates(summary)
    pub_gb = (_median(summary, "sync", "publish_bytes") or _median(summary, "async", "publish_bytes") or 0) / 1e9
    ck_gb = (_median(summary, "sync", "checkpoint_bytes") or _median(summary, "async", "checkpoint_bytes") or 0) / 1e9
    rows: list[dict[str, Any]] = [{"model": preset, "kind": "measured", "publish_gb": pub_gb, "checkpoint_gb": ck_gb}]
    rows += [{"model": name, "kind": "arithmetic", "publish_gb": gb, "checkpoint_gb": params * CKPT_BYTES_PER_PARAM
              / 1e9} for name, gb, params in BIG]
    for row in rows:
        for kind in ("publish", "checkpoint"):
            for what in ("write", "snapshot"):
                rate = r.get(f"{kind}_{what}_s_per_gb")
                row[f"{kind}_{what}_s"] = None if rate is None else rate * row[f"{kind}_gb"]
        pw, cw = row["publish_write_s"], row["checkpoint_write_s"]
        # async at v = 1 hides the writes when a step is at least this long (one publish a step, a checkpoint
        # every `every` steps, the CPU or disk not shared with the step)
        row["hidden_if_step_s"] = None if pw is None else pw + (cw or 0.0) / every
    return {"from": preset, "rates_s_per_gb": r, "rows": rows}


def extrapolation_lines(ex: dict[str, Any]) -> list[str]:
    r = ex["rates_s_per_gb"]
    lines = [f"extrapolation from {ex['from']}'s rates (s/GB: " + ", ".join(f"{k[:-9]} {v:.2f}" for k, v in r.items())
             + "); publish bf16, checkpoint fp32 master + AdamW (12 bytes/param):",
             f"  {'model':<14}{'kind':>12}{'pub GB':>9}{'pub write s':>13}{'pub snap s':>12}{'ckpt GB':>9}"
             f"{'ckpt write s':>14}{'ckpt snap s':>13}{'async hides it if step >= s':>30}"]

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else f"{v:{fmt}}"

    for row in ex["rows"]:
        lines.append(f"  {row['model']:<14}{row['kind']:>12}{row['publish_gb']:>9.2f}{f(row['publish_write_s']):>13}"
                     f"{f(row['publish_snapshot_s']):>12}{row['checkpoint_gb']:>9.1f}"
                     f"{f(row['checkpoint_write_s']):>14}{f(row['checkpoint_snapshot_s']):>13}"
                     f"{f(row['hidden_if_step_s']):>30}")
    lines.append("  (arithmetic rows: this machine's CPU and local disk at the measured rates; a GPU learner adds the "
                 "device-to-host copy to the snapshot, a shared store its own bandwidth to the write)")
    return lines


def report(plan: Plan, data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Print the tables, write ``publish.json`` (and ``publish.png``); returns the JSON's content."""
    import torch

    head = (f"bench publish: v = 1 (a publish every step), a checkpoint every {plan.checkpoint_every} steps, "
            f"{plan.groups} group(s) of G {plan.group_size} x {plan.prompt_len}+{plan.completion_len} tokens a step, "
            f"{plan.warmup}+{plan.steps} steps per arm, {plan.repeats} repeat(s), publish_dtype {plan.publish_dtype}, "
            f"fs store, {torch.get_num_threads()} torch threads")
    lines, presets = [head], {}
    for preset, d in data.items():
        summary = summarize(d["results"])
        rel = ratios(summary)
        presets[preset] = {"params": d["params"], "summary": summary, "ratios": rel, "verdict": verdict(rel)}
        lines += [f"{preset} ({d['params'] / 1e6:.1f}M params). loop s: the step loop's seconds per save (wait + "
                  "snapshot; the whole write when synchronous); write s: the write itself, in the background when "
                  "async; save s: a step's saving on the loop; drain s: the last saves, after the clock; written: "
                  "publishes and checkpoints of the timed steps, the store and versions.jsonl with the warm-up's",
                  *table(summary, plan.repeats), "  " + verdict(rel)]
    largest = max(data, key=lambda p: data[p]["params"]) if data else None
    ex = extrapolate(largest, presets[largest]["summary"], plan.checkpoint_every) if largest else None
    if ex:
        lines += extrapolation_lines(ex)
    print("\n".join(lines), flush=True)
    out = {"plan": asdict(plan), "target": TARGET, "fields": FIELDS, "machine": machine(),
           "command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "presets": presets, "extrapolation": ex, "results": {p: d["results"] for p, d in data.items()}}
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "publish.json").write_text(json.dumps(out, indent=1, default=str))
    wrote = [plan.out / "publish.json"]
    if figure(presets, plan.out / "publish.png", head):
        wrote.append(plan.out / "publish.png")
    print(f"[bench publish] wrote {' and '.join(str(p) for p in wrote)}", flush=True)
    return out


def figure(presets: dict[str, dict[str, Any]], path: Path, title: str) -> bool:
    """Per preset, each arm's step time (median, min-max) and its training part; the target as a dashed line."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(6.0, 4.5 * len(presets))
    fig, axes = plt.subplots(1, len(presets), figsize=(width, 4.5), squeeze=False)
    for ax, (preset, p) in zip(axes[0], presets.items(), strict=True):
        s = p["summary"]
        arms = [a for a in s if "step_s" in s[a]]
        med = [s[a]["step_s"]["median"] for a in arms]
        err = [[m - s[a]["step_s"]["min"] for a, m in zip(arms, med, strict=True)],
               [s[a]["step_s"]["max"] - m for a, m in zip(arms, med, strict=True)]]
        ax.bar(arms, med, yerr=err, capsize=4, color=["#888" if a == "none" else "#2a7" for a in arms],
               label="step")
        ax.bar(arms, [s[a]["train_s"]["median"] for a in arms], width=0.4, color="#246", label="train_step")
        if "none" in s:
            ax.axhline(TARGET * s["none"]["step_s"]["median"], ls="--", color="k", label=f"{TARGET:.2f}x none")
        ax.set_title(f"{preset} ({p['params'] / 1e6:.1f}M params)", fontsize=9)
        ax.set_ylabel("seconds per learner step (median, min-max)")
        ax.legend(fontsize=7)
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.suptitle(textwrap.fill(title, int(16 * width)), fontsize=7)  # the header names the whole plan: wrap
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
