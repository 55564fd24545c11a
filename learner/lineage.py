"""The lineage: one JSON line per learner step with the groups it trained (id, version, staleness, partition,
offset) and the groups it dropped (with the reason). It is how users and tests prove exactly-once training.

Lines are flushed at every step (a ``kill -9`` cannot lose flushed lines: they are in the page cache) and
fsynced at checkpoints. After a restart from the checkpoint of step ``s``, lines of steps > ``s`` describe
updates that died with the process; :meth:`Lineage.truncate_after` removes them so the file describes exactly
the updates the model carries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Lineage:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def record(self, step: int, trained: list[dict[str, Any]], dropped: list[dict[str, Any]],
               **extra: Any) -> None:
        line = {"step": step, "trained": trained, "dropped": dropped, **extra}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def truncate_after(self, step: int) -> int:
        """Drop lines of steps > ``step`` (atomically); returns how many were dropped."""
        self._file.close()
        kept, dropped = [], 0
        for line in read_lines(self.path):
            if line["step"] <= step:
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


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """Parsed lineage lines; a torn last line (killed mid-write) is skipped."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for raw in f:
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue
