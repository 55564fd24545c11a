"""What both weight stores share: the version layout on disk, names, hashing and copying, garbage collection,
and the one error type a receiver sees (:class:`WeightFetchError`).

A version lives in ``<dir>/<run>/v<version:08d>/model.safetensors`` whichever store wrote it: the fs store's
shared directory, or a receiver's cache of versions reassembled from Kafka.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("grpo_core.weights")

MiB = 1 << 20
MODEL_FILE = "model.safetensors"
# Bytes a chunk record needs beyond its data: msgpack field names and values, record and batch headers, key.
CHUNK_OVERHEAD_BYTES = 64 * 1024
IO_BYTES = 8 * MiB  # read/hash/write granularity: large enough that per-call overhead vanishes
STALE_S = 3600.0  # .tmp-/.trash-/.stream- leftovers of a crashed process older than this are removed by the GC
STALL_S = 60.0  # a chunk download that receives nothing for this long is retried
SEND_TIMEOUT_S = 120.0
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_VERSION_DIR_RE = re.compile(r"v(\d+)")
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


class WeightFetchError(RuntimeError):
    """Weights could not be obtained or verified; the message names the version, the location and why."""


class Transient(Exception):
    """A failure worth retrying: file missing or being replaced, hash mismatch on a shared volume, a stall."""


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 8 MiB pieces (constant memory whatever the file size)."""
    hasher = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        pump(f, hasher, size=os.fstat(f.fileno()).st_size)
    return hasher.hexdigest()


def version_dir_name(version: int) -> str:
    """``v00000042``: zero-padded so a directory listing sorts by version."""
    return f"v{version:08d}"


def check_run_name(run: str) -> str:
    """Run names become path components and chunk keys, so only ``[A-Za-z0-9._-]`` (no ``/``, no ``..``)."""
    if not _RUN_RE.fullmatch(run) or run in (".", ".."):
        raise ValueError(f"run name {run!r}: use 1-200 characters of [A-Za-z0-9._-], starting alphanumeric")
    return run


def pump(src: io.RawIOBase, hasher: Any, dst: BinaryIO | None = None, size: int | None = None) -> int:
    """Copy ``src`` to its end into ``dst`` (if any) while hashing; two reusable buffers, no whole-file copy.

    The hash of a piece runs on a thread while this one writes it and reads the next (hashlib, file reads and
    writes all release the GIL): at 1 GB the sha256 (~0.6 s here) no longer adds to the read/write time.
    ``size``, the expected length, only sizes the buffers: a small model published or verified at every step
    would otherwise pay for zero-filling two 8 MiB buffers each time (~10 ms here, a quarter of a 1 MB publish).
    A wrong ``size`` costs speed, never bytes: the copy always runs to the end of ``src``."""
    cap = IO_BYTES if size is None else max(1, min(IO_BYTES, size))
    bufs = (bytearray(cap), bytearray(cap))
    n = src.readinto(bufs[0])
    ahead: int | None = src.readinto(bufs[1]) if n else 0
    if not ahead:  # one piece (a small model, swapped often): no hashing thread to start and join
        piece = memoryview(bufs[0])[:n]
        hasher.update(piece)
        if dst is not None:
            write_all(dst, piece)
        return n
    k, total = 0, 0
    with ThreadPoolExecutor(1, thread_name_prefix="hash") as pool:
        while n:
            piece = memoryview(bufs[k])[:n]
            hashed = pool.submit(hasher.update, piece)
            if dst is not None:
                write_all(dst, piece)
            k ^= 1
            # The other buffer (already read once, above): the hash is still reading this one's sibling.
            n_next = ahead if ahead is not None else src.readinto(bufs[k])
            ahead = None
            hashed.result()
            total, n = total + n, n_next
    return total


def write_all(dst: BinaryIO, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = dst.write(view)
        view = view[written:]


def remove_tree(path: Path) -> None:
    """Rename aside first (atomic: readers see the version or nothing), then delete at leisure. On NFS a file
    another client holds open survives as ``.nfsXXXX`` and the rmtree leaves it; a later GC retries."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("weight store: cannot remove %s: %s", path, exc)
        return
    shutil.rmtree(trash, ignore_errors=True)


def gc_versions(run_dir: Path, keep: int, protect: str, rescue: Path | None = None) -> list[str]:
    """Delete all but the newest ``keep`` version directories, never ``protect`` (the one just written,
    which may not be the highest number after a learner rewound to a checkpoint). Also sweeps stale
    ``.tmp-``/``.trash-`` leftovers of crashed processes. Returns the names deleted. ``rescue``: move the newest
    doomed version's model file there first (the fs store writes the next version over it)."""
    versions = sorted((int(m[1]), p) for p in run_dir.iterdir()
                      if (m := _VERSION_DIR_RE.fullmatch(p.name)) and p.is_dir())
    doomed = [p for _, p in versions[:-keep] if p.name != protect]
    for i, p in enumerate(doomed):
        if rescue is not None and i == len(doomed) - 1:
            with contextlib.suppress(FileNotFoundError):
                os.replace(p / MODEL_FILE, rescue)
        remove_tree(p)
    now = time.time()
    for p in run_dir.iterdir():
        if p.name.startswith((".tmp-", ".trash-", ".stream-")):
            try:
                stale = now - p.lstat().st_mtime > STALE_S
            except FileNotFoundError:
                continue
            if stale and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif stale:
                p.unlink(missing_ok=True)
    if doomed:
        log.info("weight store: removed %s from %s (keep=%d)", [p.name for p in doomed], run_dir, keep)
    return [p.name for p in doomed]


def parse_kafka_location(location: str) -> tuple[str, int | None, int | None]:
    """``topic:partition:offset`` or a bare ``topic`` (Kafka topic names cannot contain ``:``)."""
    parts = location.split(":")
    if len(parts) == 1 and parts[0]:
        return parts[0], None, None
    if len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2])
    raise ValueError(f"kafka location {location!r}: expected 'topic:partition:offset' or 'topic'")

