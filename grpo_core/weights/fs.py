"""The ``fs`` weight store: a directory shared by the learner and the producers (NFS, a k8s RWX volume, one disk).

::

    <root>/<run>/v<version:08d>/model.safetensors     # the announced, hashed file
    <root>/<run>/v<version:08d>/config.json ...       # optional extra files passed to publish()

A version is written into ``<root>/<run>/.tmp-...`` (same parent, so the rename is atomic), fsynced, then renamed
into place: a reader sees a complete version or none. ``location`` is the model file's path *relative to the store
root* (``<run>/v00000003/model.safetensors``), so the learner and the producers may mount the volume at different
paths; each resolves it against its own ``root`` (an absolute ``location`` is used as is). The fetcher verifies
the file in place (no copy: the swap budget is < 1 s/GB) and returns its path. Garbage collection keeps the newest
``keep`` versions and never the version just published; a doomed version is first renamed to ``.trash-...`` and
then deleted, so readers never see half of one. A producer that has the file open keeps reading it (POSIX unlink
semantics); one that comes too late gets "missing" after the retries and moves on to the newest announcement.
The model file of the newest version the GC retires is kept as ``.spare-model.safetensors`` and the next version is
written over it (page-cache pages reused): a reader still on that retired version, ``keep`` versions behind, then
sees its bytes change, fails the sha256 check and moves on to the newest announcement, as it would after a delete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from grpo_core import wire
from grpo_core.fsutil import fsync_dir
from grpo_core.weights.common import (
    MODEL_FILE,
    Transient,
    WeightFetchError,
    gc_versions,
    pump,
    remove_tree,
    version_dir_name,
)
from grpo_core.weights.config import FsStoreConfig
from grpo_core.weights.payload import Payload, open_source

SPARE = ".spare-" + MODEL_FILE  # a retired version's model file, overwritten by the next publication


class FsStore:
    """Publish into and fetch from the shared directory ``cfg.root``."""

    kind = "fs"

    def __init__(self, cfg: FsStoreConfig) -> None:
        self.cfg = cfg

    def publish(self, run: str, version: int, files: Mapping[str, Path | Payload]) -> wire.WeightsAnnouncement:
        run_dir = Path(self.cfg.root) / run
        run_dir.mkdir(parents=True, exist_ok=True)
        final = run_dir / version_dir_name(version)
        tmp = run_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            digest, size = "", 0
            for name, src in files.items():
                hasher = hashlib.sha256()
                fin, expected = open_source(src)
                with fin, self._open_for_writing(run_dir, tmp / name, name == MODEL_FILE) as fout:
                    n = pump(fin, hasher, fout, expected)
                    fout.truncate(n)
                    os.fsync(fout.fileno())
                if name == MODEL_FILE:
                    digest, size = hasher.hexdigest(), n
            fsync_dir(tmp)
            if final.exists():  # re-publishing a version (learner restarted from a checkpoint): replace it
                remove_tree(final)
            os.rename(tmp, final)
            fsync_dir(run_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.gc(run, protect=final.name)
        return wire.WeightsAnnouncement(
            run=run, version=version, store="fs", location=f"{run}/{final.name}/{MODEL_FILE}",
            sha256=digest, size_bytes=size, published_at=wire.now())

    @staticmethod
    def _open_for_writing(run_dir: Path, path: Path, model: bool) -> BinaryIO:
        """The model file is written over the spare (the model file of the version the GC retired last) when
        there is one: overwriting pages the page cache holds costs 0.1-0.2 s/GB here, a fresh 1 GB file 0.2-2.5 s
        (page allocation and reclaim under memory pressure)."""
        spare = run_dir / SPARE
        if model:
            with contextlib.suppress(FileNotFoundError):
                os.replace(spare, path)
                return open(path, "r+b", buffering=0)  # noqa: SIM115 -- the caller closes it
        return open(path, "wb", buffering=0)  # noqa: SIM115

    def gc(self, run: str, protect: str) -> list[str]:
        run_dir = Path(self.cfg.root) / run
        return gc_versions(run_dir, self.cfg.keep, protect, rescue=run_dir / SPARE)

    def path_of(self, ann: wire.WeightsAnnouncement) -> Path:
        loc = Path(ann.location)
        if loc.is_absolute():
            return loc
        if not ann.location or ".." in loc.parts:
            raise WeightFetchError(f"fs location {ann.location!r}: expected a path inside the store root")
        return Path(self.cfg.root) / loc

    def fetch(self, ann: wire.WeightsAnnouncement) -> Path:
        """Verify the announced file in place; :class:`Transient` for what a retry may heal."""
        path = self.path_of(ann)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if st.st_size != ann.size_bytes:
                    raise Transient(f"size mismatch: {path} has {st.st_size} bytes, announced {ann.size_bytes}")
                hasher = hashlib.sha256()
                pump(f, hasher, size=st.st_size)
            now = os.stat(path)
        except FileNotFoundError:
            raise Transient(f"missing: {path} does not exist (garbage-collected, or not yet visible on this "
                            f"volume; weights.fs.root={self.cfg.root!r})") from None
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise Transient(f"{path} was replaced while it was being verified")
        if hasher.hexdigest() != ann.sha256:
            raise Transient(f"sha256 mismatch: {path} hashes to {hasher.hexdigest()}, announced {ann.sha256}")
        return path

    def close(self) -> None:
        """Nothing to release: the store is a directory."""
