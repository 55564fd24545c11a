"""The learner's incarnations as a run's files record them, for ``grpo-stream audit`` and ``inspect``.

Every learner start is a new incarnation (``grpo_learner.saving``): its count is kept in ``<out_dir>/incarnation``,
every lineage line names the incarnation that trained it, and ``versions.jsonl`` has one line per announced
version with the incarnation and the sha256 of its bytes. A learner restarted from a checkpoint older than versions
it announced announces those version numbers again under a higher incarnation: a policy version then names more
than one set of weights, and a reader must say which. Runs from before incarnations lack these records: every
reader here then says nothing (empty results), never a guess.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.jsonl import read_lines


@dataclass
class Incarnations:
    """What a run directory says about its learner's incarnations."""

    in_lineage: list[int] = field(default_factory=list)  # incarnations with lines in the lineage, ascending
    starts: int | None = None  # learner starts, from <out_dir>/incarnation (None: no such file)
    announced: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # version -> its versions.jsonl lines
    recorded: bool = False  # whether the run has a versions.jsonl (runs from before incarnations do not)

    @property
    def restarts(self) -> int | None:
        """Learner restarts: from the start count when recorded (an incarnation that died before its first
        checkpoint leaves no lineage lines), else from the lineage; None when neither records incarnations."""
        if self.starts is not None:
            return max(0, self.starts - 1)
        return len(self.in_lineage) - 1 if self.in_lineage else None

    def again(self) -> dict[int, list[int]]:
        """Versions announced under more than one incarnation -> those incarnations, ascending."""
        out = {}
        for version, lines in sorted(self.announced.items()):
            found = sorted({int(line["incarnation"]) for line in lines})
            if len(found) > 1:
                out[version] = found
        return out

    def other_weights(self) -> list[int]:
        """Versions announced with more than one sha256: the version number alone does not say which weights
        (the same bytes announced again, as a restarted learner does with its checkpoint's version, are one)."""
        return [v for v, lines in sorted(self.announced.items()) if len({line["sha256"] for line in lines}) > 1]

    def of(self, version: int) -> list[dict[str, Any]]:
        """The announcements of ``version``: one {version, incarnation, sha256} per (incarnation, sha256), in the
        order they were announced."""
        seen, out = set(), []
        for line in self.announced.get(version, []):
            key = (int(line["incarnation"]), str(line["sha256"]))
            if key not in seen:
                seen.add(key)
                out.append({"version": version, "incarnation": key[0], "sha256": key[1]})
        return out


def read_incarnations(out_dir: Path, lineage: Iterable[dict[str, Any]] | None = None) -> Incarnations:
    """The incarnations recorded in ``out_dir`` (the learner's out_dir); ``lineage``: its lines when the caller
    has read them already."""
    lines = read_lines(out_dir / "lineage.jsonl") if lineage is None else lineage
    found = Incarnations(in_lineage=sorted({int(line["incarnation"]) for line in lines if "incarnation" in line}))
    count = out_dir / "incarnation"
    if count.exists():
        try:
            found.starts = int(count.read_text().strip()) + 1
        except ValueError:
            found.starts = None  # torn by hand: the lineage still tells
    found.recorded = (out_dir / "versions.jsonl").exists()
    for line in read_lines(out_dir / "versions.jsonl"):
        found.announced.setdefault(int(line["version"]), []).append(line)
    return found


def incarnation_list(incarnations: Iterable[int]) -> str:
    """``0``, ``0 and 1``, ``0, 1 and 2``."""
    names = [str(i) for i in incarnations]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def describe_again(again: dict[int, list[int]]) -> str:
    """Versions announced again, as runs of neighbours sharing incarnations:
    ``v11-v15 (incarnations 0 -> 1), v40 (incarnations 1 -> 2)``; "" when none."""
    runs: list[tuple[int, int, list[int]]] = []
    for version, incs in sorted(again.items()):
        if runs and runs[-1][2] == incs:
            runs[-1] = (runs[-1][0], version, incs)
        else:
            runs.append((version, version, incs))
    return ", ".join(f"v{a}" + (f"-v{b}" if b != a else "") + f" (incarnations {' -> '.join(map(str, incs))})"
                     for a, b, incs in runs)
