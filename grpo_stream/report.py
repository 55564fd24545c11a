"""``grpo-stream report runs/<name>``: the run's picture (report.png) from its own records.

Panels: reward vs learner step (train: the mean reward of each step's groups; held-out: eval.jsonl points),
the held-out reward over wall time (when it came, not only at which step), the staleness histogram of trained
groups (from the lineage), and learner throughput over wall time.
``grpo-stream report --compare DIR DIR ...`` overlays runs instead (a replay beside its original, ablations):
train reward and loss vs step, one line per run, into the first directory's ``compare.png``.
"""

from __future__ import annotations

from pathlib import Path

from grpo_core.jsonl import read_lines


def write_report(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    metrics = list(read_lines(run / "metrics.jsonl"))
    evals = list(read_lines(run / "eval.jsonl"))
    staleness = [e["staleness"] for line in read_lines(run / "lineage.jsonl") for e in line["trained"]]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    if metrics:
        ax.plot([m["step"] for m in metrics], [m.get("reward_mean", 0.0) for m in metrics], lw=0.8, alpha=0.7,
                label="train (batch mean)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_reward"] for e in evals], "o-", color="C3", label="held-out")
    ax.set(title="reward", xlabel="learner step", ylim=(-0.02, 1.02))
    ax.legend(loc="lower right")
    ax = axes[1]
    if evals and "time" in evals[0]:
        ax.plot([(e["time"] - evals[0]["time"]) / 60 for e in evals], [e["eval_reward"] for e in evals], "o-",
                color="C3")
    ax.set(title="held-out reward over time", xlabel="minutes since the run started", ylim=(-0.02, 1.02))
    ax = axes[2]
    if staleness:
        ax.hist(staleness, bins=range(0, max(staleness) + 2), align="left", rwidth=0.85)
    ax.set(title="staleness of trained groups", xlabel="learner steps behind", ylabel="groups")
    ax = axes[3]
    if metrics and "time" in metrics[0]:
        t0 = metrics[0]["time"]
        rate = [m.get("tokens", 0) / max(sum(m.get("timings", {}).values()), 1e-9) for m in metrics]
        ax.plot([m["time"] - t0 for m in metrics], rate, lw=0.5, alpha=0.35, label="per step")
        k = min(20, len(rate))  # per-step rates are noisy (waits, publishes): show a running mean too
        smooth = [sum(rate[max(0, i - k + 1):i + 1]) / len(rate[max(0, i - k + 1):i + 1]) for i in range(len(rate))]
        ax.plot([m["time"] - t0 for m in metrics], smooth, lw=1.2, label=f"mean of {k} steps")
        ax.legend(loc="lower right")
    ax.set(title="learner throughput", xlabel="seconds", ylabel="completion tokens / s")
    fig.suptitle(run.name)
    fig.tight_layout()
    out = run / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def write_comparison(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [Path(d) for d in run_dirs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, run in enumerate(runs):
        metrics = list(read_lines(run / "metrics.jsonl"))
        steps = [m["step"] for m in metrics]
        for ax, key in zip(axes, ("reward_mean", "loss"), strict=True):
            ax.plot(steps, [m.get(key, float("nan")) for m in metrics], lw=0.9, color=f"C{i}", label=run.name)
    axes[0].set(title="train reward (batch mean)", xlabel="learner step")
    axes[1].set(title="loss", xlabel="learner step")
    for ax in axes:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(out) if out else runs[0] / "compare.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
