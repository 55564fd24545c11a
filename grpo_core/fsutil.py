"""Durable file-system steps shared by the checkpoint writer and the weight store."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename/creation in ``path`` durable (the entry itself lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into(tmp: Path, out: Path, marker: str) -> None:
    """Move everything built in ``tmp`` into ``out``, the ``marker`` file last: its presence means "complete",
    so it is removed first and written only after every other file is in place."""
    out.mkdir(exist_ok=True)
    (out / marker).unlink(missing_ok=True)
    for f in sorted(tmp.iterdir()):
        if f.name != marker:
            os.replace(f, out / f.name)
    os.replace(tmp / marker, out / marker)
