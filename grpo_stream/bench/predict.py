"""``grpo-stream bench predict``: a run's time to a reward target, predicted from the two effects apart.

    predicted seconds = (steps to target - 1) / steps per second

* **Steps to target** is the algorithmic effect, read from a learning run (a ``grpo-stream demo`` or sweep run
  directory): the learner step of the first published version from which two evaluations in a row are at or
  above the target (``eval.jsonl``; the demo's own stop rule).
* **Steps per second** is the systems effect, measured with no learning by ``bench throughput`` (an arm's median
  over its repeats, e.g. ``P demo`` for the demo's pipeline).
* **Measured seconds**, to check the prediction against: the same run's clock (``metrics.jsonl``) from the end
  of its first learner step to the end of the step that reached the target. Both leave start-up out.

Printed per run: steps, predicted and measured seconds and the error (predicted / measured - 1); then the mean
absolute error. Written: ``predict.json`` beside the throughput JSON.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from grpo_core.jsonl import read_lines


def steps_to_target(evals: list[dict[str, Any]], target: float) -> int | None:
    """The step of the first evaluation from which two in a row hold ``target`` (None: never)."""
    for a, b in zip(evals, evals[1:], strict=False):
        if a["eval_reward"] >= target and b["eval_reward"] >= target:
            return int(a["step"])
    return None


def measured_seconds(metrics: list[dict[str, Any]], step: int) -> float | None:
    """Seconds from the end of learner step 1 to the end of ``step`` (None: the run has no such step)."""
    at = {int(m["step"]): float(m["time"]) for m in metrics}
    if 1 not in at or step not in at:
        return None
    return at[step] - at[1]


def predict_run(run: Path, steps_per_s: float, target: float) -> dict[str, Any]:
    evals = list(read_lines(run / "eval.jsonl"))
    step = steps_to_target(evals, target)
    row: dict[str, Any] = {"run": str(run), "steps_to_target": step, "predicted_s": None, "measured_s": None,
                           "error": None}
    if step is None or step < 1:
        return row
    measured = measured_seconds(list(read_lines(run / "metrics.jsonl")), step)
    predicted = (step - 1) / steps_per_s
    row |= {"predicted_s": predicted, "measured_s": measured,
            "error": None if not measured else predicted / measured - 1}
    return row


def main(throughput: str, runs: list[str], arm: str, target: float) -> int:
    path = Path(throughput)
    data = json.loads(path.read_text())
    if arm not in data["summary"]:
        raise SystemExit(f"bench predict --arm {arm!r}: not in {path} (arms: {sorted(data['summary'])})")
    if not runs:
        raise SystemExit("bench predict: name the learning runs to check (run directories with eval.jsonl)")
    rate = data["summary"][arm]["steps_per_s"]["median"]
    rows = [predict_run(Path(r), rate, target) for r in runs]
    print(f"time to held-out {target}: predicted = (steps to target - 1) / {rate:.3f} steps/s ({arm}, {path})")
    print(f"{'run':<40} {'steps':>6} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for r in rows:
        cells = [f"{r['steps_to_target'] or '-':>6}", *(f"{r[k]:>{w}.1f}" if r[k] is not None else f"{'-':>{w}}"
                                                      for k, w in (("predicted_s", 12), ("measured_s", 11))),
                 f"{r['error']:>+7.1%}" if r["error"] is not None else f"{'-':>7}"]
        print(f"{r['run']:<40} " + " ".join(cells))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    mean_abs = statistics.fmean(errors) if errors else None
    if mean_abs is not None:
        print(f"mean absolute error {mean_abs:.1%} over {len(errors)} run(s)")
    out = path.parent / "predict.json"
    out.write_text(json.dumps({"throughput": str(path), "arm": arm, "steps_per_s": rate, "target": target,
                               "runs": rows, "mean_abs_error": mean_abs}, indent=1))
    print(f"[bench predict] wrote {out}")
    return 0
