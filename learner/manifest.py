"""Checkpoint integrity: a sha256 and a size for every file of a checkpoint, written with it (``manifest.json``)
and verified before it is used.

Why: a checkpoint is the state exactly-once training resumes from. A file damaged on disk (a bad block, an
operator's copy gone wrong, a truncated write on a full volume) must never be loaded silently: its weights would be
published to every producer and carried into every later checkpoint. ``grpo_learner.checkpoint`` skips a checkpoint
that fails :func:`verify` for the previous intact one.

Hashes are taken while the files are written (:class:`HashingWriter`: no read back) where the writer is ours, and
by reading the file back otherwise (the sharded layout, written by ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, BinaryIO

from grpo_core.weights.common import sha256_file

MANIFEST = "manifest.json"
FORMAT = "sha256-v1"  # meta.json's "integrity": a checkpoint that says it has a manifest and lacks it is damaged


class HashingWriter:
    """A writable binary file that hashes and counts what passes through it (for ``torch.save`` and payloads)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.hasher, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        n = self.f.write(data) or 0
        self.hasher.update(memoryview(data)[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict[str, Any]:
        return {"sha256": self.hasher.hexdigest(), "bytes": self.size}


def write_manifest(root: Path, known: dict[str, dict[str, Any]]) -> None:
    """Write ``root/manifest.json`` for every file under ``root``: ``known`` entries (relative path -> entry of a
    :class:`HashingWriter`) as given, every other file hashed now."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            rel = path.relative_to(root).as_posix()
            files[rel] = known.get(rel) or {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (root / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def verify(path: Path) -> str:
    """``""`` when every file the manifest lists is there with its size and sha256, else the first problem found,
    naming the file. Sizes are checked first (cheap: a truncated file is found without reading anything)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(rel, int(e["bytes"]), str(e["sha256"])) for rel, e in files.items()]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    for rel, size, _ in entries:
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
    for rel, _, digest in entries:
        actual = sha256_file(path / rel)
        if actual != digest:
            return f"{rel} does not match its sha256 (manifest {digest[:12]}, file {actual[:12]}): damaged"
    return ""
