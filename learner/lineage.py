"""The lineage: one JSON line per learner step with the groups it trained (id, version, staleness, partition,
offset) and the groups it dropped (with the reason). It is how users and tests prove exactly-once training:
every offset of the groups topic is trained, dropped with a reason, or inside an ``operator_skip`` range (an
operator's deliberate ``skip_to``, recorded on a line of its own with empty trained/dropped lists).

Lines are flushed at every step (a ``kill -9`` cannot lose flushed lines: they are in the page cache) and
fsynced at checkpoints. After a restart from the checkpoint of step ``s``, lines of steps > ``s`` describe
updates that died with the process; :meth:`Lineage.truncate_after` removes them so the file describes exactly
the updates the model carries.

Every line names the learner's incarnation (its start count, ``grpo_learner.saving``) that trained it.

A ``no_update`` line (empty trained list) accounts for groups dropped with nothing trainable left to take them
with -- the tail of a finite feed -- at the current step, without an update; its checkpoint follows at once. It
survives a restart only if that checkpoint's position is past its offsets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grpo_core.jsonl import read_lines

__all__ = ["Lineage", "read_lines"]


class Lineage:
    def __init__(self, path: Path, incarnation: int = 0) -> None:
        self.path, self.incarnation = path, incarnation
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def record(self, step: int, trained: list[dict[str, Any]], dropped: list[dict[str, Any]],
               **extra: Any) -> None:
        line = {"step": step, "incarnation": self.incarnation, "trained": trained, "dropped": dropped, **extra}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def skips(self) -> list[dict[str, int]]:
        """Every ``operator_skip`` range recorded (a skip repeated after a crash is recorded once)."""
        return [r for line in read_lines(self.path) for r in line.get("operator_skip", [])]

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def truncate_after(self, step: int, position: dict[int, int]) -> int:
        """Drop lines of steps > ``step`` and ``no_update`` lines with an offset at or past ``position``
        (partition -> the checkpoint's next offset), atomically; returns how many were dropped."""
        def carried(line: dict[str, Any]) -> bool:
            if line["step"] > step:
                return False
            return not line.get("no_update") or all(e["offset"] < position.get(e["partition"], 0)
                                                     for e in line["dropped"])

        self._file.close()
        kept, dropped = [], 0
        for line in read_lines(self.path):
            if carried(line):
                kept.append(line)
            else:
                dropped += 1
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        self._file.close()
