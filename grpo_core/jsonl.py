"""JSON Lines files that a process appends to and others read while it runs (lineage, metrics, evals)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """Parsed lines; a torn last line (its writer killed mid-write) is skipped, a missing file is empty."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for raw in f:
            try:
                yield json.loads(raw)
            except json.JSONDecodeError:
                continue
