"""CPU time taken from this machine while a bench arm ran: "steal" in ``/proc/stat``, the time a virtual CPU was
ready to run but its host ran another guest instead.

On a shared cloud machine it comes in bursts. An arm that runs during one is slower for a reason that has nothing
to do with what it measures (a learner 25-60x slower per step for a whole repeat has been seen here, with I/O
unaffected), so ``bench async`` records the share per repeat and names every repeat above :data:`STEAL_WARN`
instead of letting it move a median silently.
"""

from __future__ import annotations

from pathlib import Path

STEAL_WARN = 0.05  # above this share of one CPU's time, a repeat's timings are not comparable with the others'

Ticks = dict[int, tuple[int, int]]  # cpu -> (all ticks so far, steal ticks so far)


def read_ticks(text: str | None = None) -> Ticks:
    """Every CPU's ticks from ``/proc/stat`` (or ``text`` in its format); {} where there is none (not Linux)."""
    if text is None:
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return {}
    out: Ticks = {}
    for line in text.splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            # user nice system idle iowait irq softirq steal; guest time is counted in user already
            ticks = [int(v) for v in values[:8]]
            out[int(name[3:])] = (sum(ticks), ticks[7] if len(ticks) > 7 else 0)
    return out


def stolen(before: Ticks, after: Ticks, cpus: set[int] | None = None) -> float | None:
    """The largest share of one CPU's time stolen between the two readings, over ``cpus`` (default: all); None
    when nothing was read or no time passed."""
    shares = [(after[c][1] - before[c][1]) / (after[c][0] - before[c][0])
              for c in sorted(before) if c in after and (cpus is None or c in cpus) and after[c][0] > before[c][0]]
    return max(shares) if shares else None


def warnings(results: dict[str, list[dict[str, object]]]) -> list[str]:
    """A line for every repeat of every arm whose stolen share is above :data:`STEAL_WARN`."""
    lines = []
    for name, runs in results.items():
        for k, run in enumerate(runs):
            share = run.get("cpu_steal")
            if isinstance(share, float) and share > STEAL_WARN:
                lines.append(f"{name}, repeat {k + 1}: the host took {share:.0%} of a CPU's time (steal); this "
                             f"repeat's timings are not comparable with the others'")
    return lines
