"""The dedup set's durable form: the ids of trained groups, appended to a log beside the checkpoints.

``<dir>/seen-00000001.jsonl`` holds one JSON string per line, oldest first. A checkpoint's ``meta.json`` names a file
and a line count (``seen_log: {file, count}``); its dedup set is the last ``dedup_window`` ids of that file's first
``count`` lines. Each checkpoint appends only the ids trained since the previous one. Before, every checkpoint
pickled the whole window into ``trainer.pt``, so a checkpoint's cost grew with the run: ~1 s and ~50 MB per
checkpoint at the default window of 1M ids, at every step when v = 1 (``checkpoint_on_publish``).

Crash safety follows the checkpoint's: new ids are appended and fsynced before the checkpoint that counts them is
committed, so a committed checkpoint never names lines that are not on disk. Lines past the newest checkpoint's count
belong to a checkpoint that was never committed; :meth:`SeenLog.restore` cuts them off. Once a file would hold more
than two windows, the window is copied into the next file (written, fsynced, renamed into place), which later
checkpoints name; a file no kept checkpoint names is deleted after the next commit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from grpo_core.fsutil import fsync_dir
from grpo_core.weights.common import write_all

FILE = re.compile(r"seen-(\d{8})\.jsonl")


class SeenLogError(RuntimeError):
    """The log does not hold what a checkpoint says it does (changed or removed outside the learner)."""


class SeenLog:
    def __init__(self, root: Path, window: int) -> None:
        self.root, self.window = root, window
        self.generation, self.count = 0, 0
        self._file: BinaryIO | None = None

    @property
    def name(self) -> str:
        return f"seen-{self.generation:08d}.jsonl"

    def ref(self) -> dict[str, Any]:
        """What a checkpoint records in its ``meta.json`` as ``seen_log``."""
        return {"file": self.name, "count": self.count}

    def start(self, ids: list[str]) -> None:
        """Begin a new file holding ``ids``: a fresh run (none), or a checkpoint from before this log, whose
        ``trainer.pt`` holds the dedup set itself. Older files, which no checkpoint names, go at the next commit."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_generation(self._highest() + 1, ids[-self.window:])

    def restore(self, ref: dict[str, Any]) -> list[str]:
        """The dedup set a checkpoint's ``seen_log`` names; the file is cut back to it and appended to from there."""
        path, count = self.root / str(ref["file"]), int(ref["count"])
        generation = _generation(path)
        if generation is None or not path.is_file():
            raise SeenLogError(f"{path}: the checkpoint's dedup log is missing; it holds the ids of trained groups "
                               "and is only written by the learner (restore the file, or use a new out_dir)")
        ids: list[str] = []
        with path.open("rb") as f:
            for _ in range(count):
                line = f.readline()
                if not line.endswith(b"\n"):
                    raise SeenLogError(f"{path}: the checkpoint counts {count} trained ids, the file holds "
                                       f"{len(ids)}; it was changed outside the learner")
                ids.append(json.loads(line))
            end = f.tell()
        os.truncate(path, end)  # lines of a checkpoint that was never committed
        for newer in self._files():  # a copy made for such a checkpoint
            if (_generation(newer) or 0) > generation:
                newer.unlink()
        self._close()
        self.generation, self.count = generation, count
        self._file = path.open("ab", buffering=0)
        return ids[-self.window:]

    def append(self, ids: list[str], window: Iterable[str]) -> dict[str, Any]:
        """Make ``ids`` (trained since the last call) durable; returns the reference for the checkpoint about to
        be committed. ``window``: the whole dedup set, ``ids`` included, copied into the next file once this one
        would hold more than two windows."""
        if self.count + len(ids) > 2 * self.window:
            self._write_generation(self.generation + 1, list(window)[-self.window:])
        elif ids:
            assert self._file is not None, "start() or restore() first"
            write_all(self._file, b"".join(json.dumps(i).encode() + b"\n" for i in ids))  # unbuffered: may be short
            os.fsync(self._file.fileno())
            self.count += len(ids)
        return self.ref()

    def gc(self, checkpoint_dirs: Iterable[Path]) -> None:
        """Delete the files that neither the kept checkpoints (``checkpoint_dirs``) nor the next one name."""
        files = self._files()
        if len(files) < 2:
            return
        named = {self.name}
        for d in checkpoint_dirs:
            meta = d / "meta.json"
            if meta.is_file():
                named.add(str(json.loads(meta.read_text()).get("seen_log", {}).get("file")))
        for f in files:
            if f.name not in named:
                f.unlink(missing_ok=True)

    def close(self) -> None:
        self._close()

    def _write_generation(self, generation: int, ids: list[str]) -> None:
        final = self.root / f"seen-{generation:08d}.jsonl"
        tmp = final.with_name(final.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(b"".join(json.dumps(i).encode() + b"\n" for i in ids))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.root)
        self._close()
        self.generation, self.count = generation, len(ids)
        self._file = final.open("ab", buffering=0)

    def _files(self) -> list[Path]:
        return sorted(p for p in self.root.glob("seen-*.jsonl") if _generation(p) is not None)

    def _highest(self) -> int:
        return max((_generation(p) or 0 for p in self._files()), default=0)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _generation(path: Path) -> int | None:
    match = FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None
