"""Where a bench arm's CPU time went, from ``/proc``: the share the host took (steal), and the CPUs each role's
process tree used.

Steal is the time a virtual CPU was ready to run but its host ran another guest instead. On a shared cloud
machine it comes in bursts; an arm that runs during one is slower for a reason that has nothing to do with what
it measures, so ``bench async`` records the share per repeat and names every repeat above :data:`STEAL_WARN`
instead of letting it move a median silently.

CPUs by role say what the pipeline's own machinery costs on the machine: the producer's tree (its vLLM engine
processes included), the learner, verifiers, feeder, and the rest of the machine's busy time (the broker, the
supervisor, the OS), which S, one process without Kafka, does not pay.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

STEAL_WARN = 0.05  # above this share of one CPU's time, a repeat's timings are not comparable with the others'
TICK_S = 1 / os.sysconf("SC_CLK_TCK")

Ticks = dict[int, tuple[int, int, int]]  # cpu -> (all ticks, steal ticks, idle + iowait ticks), so far


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
            ticks = [int(v) for v in values[:8]] + [0] * (8 - len(values[:8]))
            out[int(name[3:])] = (sum(ticks), ticks[7], ticks[3] + ticks[4])
    return out


def stolen(before: Ticks, after: Ticks, cpus: set[int] | None = None) -> float | None:
    """The largest share of one CPU's time stolen between the two readings, over ``cpus`` (default: all); None
    when nothing was read or no time passed."""
    shares = [(after[c][1] - before[c][1]) / (after[c][0] - before[c][0])
              for c in sorted(before) if c in after and (cpus is None or c in cpus) and after[c][0] > before[c][0]]
    return max(shares) if shares else None


# ---- CPUs by role ------------------------------------------------------------------------------------------------


@dataclass
class Reading:
    """The machine's CPU ticks and each named process tree's, at one moment."""

    at: float = field(default_factory=time.monotonic)
    machine: Ticks = field(default_factory=read_ticks)
    roles: dict[str, int] = field(default_factory=dict)  # name -> ticks of the process and its descendants


def read(roots: dict[str, int]) -> Reading:
    """A :class:`Reading` of the process trees rooted at ``roots`` (name -> pid)."""
    return Reading(roles=tree_ticks(roots))


def cpus_by_role(before: Reading, after: Reading) -> dict[str, float]:
    """CPUs each tree used on average between two readings (CPU seconds per second), and ``rest``: the machine's
    busy time outside them (a broker, the supervisor, the OS). A tree whose ticks went down (a role restarted in
    between: a new process) is left out, its time counted in ``rest``."""
    wall = after.at - before.at
    if wall <= 0:
        return {}
    used = {n: (t - before.roles[n]) * TICK_S / wall for n, t in after.roles.items()
            if n in before.roles and t >= before.roles[n]}
    busy = sum((a[0] - a[1] - a[2]) - (b[0] - b[1] - b[2])
               for c, a in after.machine.items() if (b := before.machine.get(c)) is not None)
    return used | {"rest": max(0.0, busy * TICK_S / wall - sum(used.values()))}


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, utime + stime ticks) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[1]), int(fields[11]) + int(fields[12])


def tree_ticks(roots: dict[str, int]) -> dict[str, int]:
    """CPU ticks so far of each named process and its live descendants (a producer's vLLM engine processes)."""
    procs = {int(pid): st for pid in os.listdir("/proc") if pid.isdigit() and (st := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    out = {}
    for name, root in roots.items():
        todo, ticks = [root], 0
        while todo:
            pid = todo.pop()
            ticks += procs[pid][1] if pid in procs else 0
            todo.extend(children.get(pid, ()))
        out[name] = ticks
    return out


def role_pids(run_dir: Path) -> dict[str, int]:
    """The run supervisor's children (its ``children.json``): name -> pid."""
    try:
        data = json.loads((run_dir / "children.json").read_text())
    except (OSError, ValueError):
        return {}
    return {name: int(c["pid"]) for name, c in data.items() if c.get("pid")}


def format_cpus(name: str, cpus: dict[str, float]) -> str:
    return f"{name}: " + ", ".join(f"{role} {v:.2f}" for role, v in sorted(cpus.items(), key=lambda x: -x[1]))
