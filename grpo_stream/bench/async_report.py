"""``bench async``'s report: when an arm reached the target, the per-arm table (median, min and max over repeats),
the ideal ratio from S's phase times, ratios at neighbouring targets, the learner's per-step dynamics, and the
JSON and PNG. Pure functions of the arms' results (:mod:`grpo_stream.bench.async_bench` runs the arms)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from grpo_stream.bench.cpu_use import STEAL_WARN, format_cpus

# The learner metrics averaged per arm (`dynamics`), over its first EARLY_STEPS steps and over all: the pipeline
# arms gained more held-out reward per learner step than S; these say what differed in the batches and the policy.
DYNAMICS = ("entropy", "zero_variance_fraction", "clip_frac_low", "clip_frac_high", "reward_mean", "cpu_share")
# A learner step on this CPU computes all the time it runs: a repeat whose learner had its CPU for less than this
# share of its step time was held up by something else on the machine, and is named under the table.
LOW_CPU_SHARE = 0.5
EARLY_STEPS = 30


def dynamics(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Means of the learner's per-step metrics (:data:`DYNAMICS`, ``steps`` in step order) over the first
    :data:`EARLY_STEPS` steps -- the rise, where the arms' rewards per step part -- and over all of them, keyed
    ``<metric>_early`` / ``<metric>_all``: what the policy and its batches looked like, step for step."""
    out: dict[str, float | None] = {}
    for window, rows in (("early", steps[:EARLY_STEPS]), ("all", steps)):
        for key in DYNAMICS:
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            out[f"{key}_{window}"] = statistics.fmean(values) if values else None
    return out


def reached(curve: list[Any], target: float) -> Any | None:
    """The first evaluated point from which the reward holds at ``target`` for two evaluations in a row (as the
    demo's stop rule): one lucky version on a noisy curve does not count, and a crossing at the very last point,
    unconfirmed, does not either."""
    return next((a for a, b in zip(curve, curve[1:], strict=False) if a[1] >= target and b[1] >= target), None)


def time_to(curve: list[Any], target: float) -> float | None:
    point = reached(curve, target)
    return None if point is None else point[0]


def steps_to(curve: list[Any], target: float) -> int | None:
    """Learner steps to the target: beside the seconds, it shows what staleness cost in updates."""
    point = reached(curve, target)
    return None if point is None or len(point) < 3 else point[2]


# ------------------------------------------------------------------------------------------ the report


FIELDS = ("time_to_target_s", "ratio_to_S", "steps_to_target", "reward_gain_per_s", "tokens_per_s", "engine_busy",
          "learner_busy", "mean_staleness", "steps", "final_reward", "cpu_steal", "learner_cpu_share")


def arm_row(result: dict[str, Any], target: float, sync_ttt: float | None) -> dict[str, Any]:
    curve = result["curve"]
    ttt = time_to(curve, target)
    first, last = (curve[0][1], curve[-1][1]) if curve else (0.0, 0.0)
    return {"time_to_target_s": ttt, "ratio_to_S": None if ttt is None or not sync_ttt else ttt / sync_ttt,
            "steps_to_target": steps_to(curve, target),
            "reward_gain_per_s": (last - first) / result["wall_s"], "tokens_per_s": result["tokens"] / result["wall_s"],
            "engine_busy": result["engine_busy"], "learner_busy": result["learner_busy"],
            "mean_staleness": result["mean_staleness"], "steps": result["steps"], "final_reward": last,
            "cpu_steal": result.get("cpu_steal"),
            "learner_cpu_share": _learner_cpu_share(result)}


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def report(results: dict[str, list[dict[str, Any]]], target: float, out: Path) -> dict[str, Any]:
    s_runs = results.get("S", [])
    gen = statistics.fmean(r["gen_s"] for r in s_runs) if s_runs else None
    train = statistics.fmean(r["train_s"] for r in s_runs) if s_runs else None
    ideal = max(gen, train) / (gen + train) if gen is not None and train is not None else None
    sync_ttt = sync_time_to(results, target)
    table: dict[str, Any] = {}
    if gen is not None and train is not None:
        print(f"target held-out reward {target}; S: gen {gen:.1f}s + train {train:.1f}s -> ideal ratio "
              f"{ideal:.3f} (gen/train {gen / max(train, 1e-9):.2f})")
    else:
        print(f"target held-out reward {target}; no arm S in this run: no ratios to S, no ideal ratio")
    print(f"{'arm':<15} " + " ".join(f"{f:>17}" for f in FIELDS))
    for name, runs in results.items():
        rows = [arm_row(r, target, sync_ttt) for r in runs]
        table[name] = {"runs": rows, "median": {f: _median_of(f, [row[f] for row in rows]) for f in FIELDS},
                       "min": {f: _pick(min, [row[f] for row in rows]) for f in FIELDS},
                       "max": {f: _max_of(f, [row[f] for row in rows]) for f in FIELDS}}
        print(f"{name:<15} " + " ".join(f"{_fmt(table[name]['median'][f]):>17}" for f in FIELDS))
        if len(rows) > 1:
            print(f"{'  min/max':<15} " + " ".join(
                f"{_fmt(table[name]['min'][f]) + '/' + _fmt(table[name]['max'][f]):>17}" for f in FIELDS))
    for line in held_up(results):
        print(line)
    best = min((v["median"]["ratio_to_S"] for k, v in table.items() if k.startswith("P")
                and v["median"]["ratio_to_S"] is not None), default=None)
    print(f"best pipeline ratio to S: {_fmt(best)} (target <= 0.65); ideal {_fmt(ideal)}; "
          f"gap {_fmt(None if best is None or ideal is None else best / ideal)} (target <= 1.15)")
    cpus = cpu_table(results)
    held = held_back_table(results)
    sensitivity = ratios_by_target(results, sorted({round(target + d, 2) for d in (-0.1, -0.05, 0.0, 0.05, 0.1)}))
    warmup = statistics.fmean(r.get("warmup_s", 0.0) for r in s_runs) if s_runs else None  # outside S's clock
    summary = {"target": target, "ideal_ratio": ideal, "sync_gen_s": gen, "sync_train_s": train,
               "sync_warmup_s": warmup,
               "best_pipeline_ratio": best, "arms": table, "ratio_by_target": sensitivity,
               "dynamics": dynamics_table(results), "cpu_by_role": cpus, "held_back": held,
               "curves": {k: [r["curve"] for r in v] for k, v in results.items()}}
    (out / "async.json").write_text(json.dumps(summary, indent=2))
    _plot(results, target, out / "async.png")
    return summary


def medians_by_key(results: dict[str, list[dict[str, Any]]], field: str, title: str,
                   line: Callable[[str, dict[str, Any]], str]) -> dict[str, dict[str, float]]:
    """Per arm, the median over its repeats of each key of the dict-valued ``field`` (a repeat without it: None),
    printed under ``title`` a ``line`` per arm that has any."""
    table: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        keys = sorted({k for run in runs for k in run.get(field) or {}})
        table[name] = {k: _median([(run.get(field) or {}).get(k) for run in runs]) for k in keys}
    if any(table.values()):
        print(title)
        for name, row in table.items():
            if row:
                print("  " + line(name, row))
    return table


def cpu_table(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """CPUs each role's process tree used while an arm's clock ran (median of repeats), a line per arm: what the
    pipeline's own machinery (broker, verifier, feeder, the producer's Kafka side) takes from generation and
    learning on this machine, which S does not pay."""
    return medians_by_key(results, "cpu_by_role", "CPUs used while the clock ran, by process tree (a producer's "
                          "includes its vLLM engine; rest: the broker, the supervisor, the OS):", format_cpus)


def held_back_table(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """The share of a pipeline arm's clock its producer left room in the engine unfilled, per reason (median of
    repeats): held back on purpose because the learner has enough queued ("backlog") or the producer's weights are
    too old ("version_lag"), or for want of work: no prompt to take ("no_prompts", in-flight swaps only)."""
    return medians_by_key(results, "held_back", "share of the clock the producer left room in its engine unfilled, "
                          "by reason (held back by backpressure: backlog, version_lag; no prompt to take, "
                          "counted by in-flight producers only: no_prompts):",
                          lambda name, row: f"{name}: " + ", ".join(
                              f"{r} {v:.3f}" for r, v in row.items() if v is not None))


def held_up(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A line for every repeat the machine held up: the host took more than :data:`STEAL_WARN` of a CPU's time
    (steal), or its learner had a CPU for less than :data:`LOW_CPU_SHARE` of its step time."""
    lines = []
    for name, runs in results.items():
        for k, run in enumerate(runs):
            steal, share = run.get("cpu_steal"), _learner_cpu_share(run)
            if steal is not None and steal > STEAL_WARN:
                lines.append(f"{name}, repeat {k + 1}: the host took {steal:.0%} of a CPU's time (steal); this "
                             f"repeat's timings are not comparable with the others'")
            if share is not None and share < LOW_CPU_SHARE:
                lines.append(f"{name}, repeat {k + 1}: the learner had a CPU for {share:.0%} of its step time; "
                             f"this repeat's timings are not comparable with the others'")
    return lines


def _learner_cpu_share(result: dict[str, Any]) -> float | None:
    """The learner's mean ``cpu_share`` over the repeat's steps (None: results from before the metric)."""
    return (result.get("dynamics") or {}).get("cpu_share_all")


def sync_time_to(results: dict[str, list[dict[str, Any]]], target: float) -> float | None:
    """S's median time to ``target`` (a run that never reached it counts as the slowest): what every ratio divides
    by (None: half or more of S's runs never reached it, or no S run)."""
    return _median_to_target([time_to(r["curve"], target) for r in results.get("S", [])])


def ratios_by_target(results: dict[str, list[dict[str, Any]]], targets: list[float]) -> dict[str, dict[str, Any]]:
    """Median ratio to S of every pipeline arm at targets around the chosen one, printed as a table: a conclusion
    that holds at one target only is an artefact of where the target fell on a noisy curve."""
    table: dict[str, dict[str, Any]] = {}
    for target in targets:
        sync = sync_time_to(results, target)
        table[f"{target:.2f}"] = {name: _median_to_target([None if t is None or not sync else t / sync for t in
                                                           (time_to(r["curve"], target) for r in runs)])
                                  for name, runs in results.items() if name.startswith("P")}
    names = sorted({n for row in table.values() for n in row})
    print("median ratio to S by target: " + " | ".join(
        f"{t}: " + ", ".join(f"{n} {_fmt(row[n])}" for n in names) for t, row in table.items()))
    return table


def dynamics_table(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's :func:`dynamics`, median over its repeats, printed a line per arm (early | all)."""
    keys = [f"{k}_{w}" for w in ("early", "all") for k in DYNAMICS]
    table = {name: {k: _median([r.get("dynamics", {}).get(k) for r in runs]) for k in keys}
             for name, runs in results.items()}
    print(f"learner metrics, mean per step over the first {EARLY_STEPS} steps | all steps (median of repeats):")
    print(f"{'arm':<15} " + " ".join(f"{k:>23}" for k in DYNAMICS))
    for name, row in table.items():
        print(f"{name:<15} " + " ".join(f"{_fmt(row[k + '_early']) + ' | ' + _fmt(row[k + '_all']):>23}"
                                        for k in DYNAMICS))
    return table


TO_TARGET = ("time_to_target_s", "ratio_to_S", "steps_to_target")  # None: that repeat never reached the target


def _median_to_target(values: list[Any]) -> Any:
    """The median of times (or steps, or ratios) to the target, a repeat that never reached it counting as slower
    than every one that did: dropping it would report the arm's lucky repeats only. None when the median repeat
    itself never reached the target."""
    ordered = sorted(values, key=lambda v: (v is None, v if v is not None else 0))
    n = len(ordered)
    middle = ordered[(n - 1) // 2:n // 2 + 1] if n else [None]
    return None if None in middle else statistics.fmean(cast(list[float], middle)) if len(middle) == 2 else middle[0]


def _median_of(field: str, values: list[Any]) -> Any:
    return _median_to_target(values) if field in TO_TARGET else _median(values)


def _max_of(field: str, values: list[Any]) -> Any:
    """The largest value; for a field to the target, None ("-") when a repeat never reached it."""
    return None if field in TO_TARGET and None in values else _pick(max, values)


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _pick(fn: Any, values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return fn(known) if known else None


def _plot(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, runs) in enumerate(results.items()):
        for k, r in enumerate(runs):
            ax.plot([c[0] for c in r["curve"]], [c[1] for c in r["curve"]], "o-", ms=3, color=f"C{i}",
                    alpha=0.9 if k == 0 else 0.4, label=name if k == 0 else None)
    ax.axhline(target, ls="--", color="grey", lw=0.8)
    ax.set(xlabel="wall-clock seconds (from the first generated token)", ylabel="held-out reward (positions)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
