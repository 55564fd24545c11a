"""Atomic learner checkpoints: model + optimizer + scheduler + RNG + step + the next ``groups`` offsets.

Layout: ``<dir>/step-00000042/{model/model.safetensors, trainer.pt, meta.json}`` and ``<dir>/latest`` naming the
newest one; ``meta.json`` also names the checkpoint's position in the dedup log beside them
(``grpo_learner.seen_log``). A checkpoint is written into a hidden temporary directory, fsynced, then renamed into
place, and only then does ``latest`` move (also by rename): a process killed at any instant leaves either the
previous checkpoint or the new one, never a torn mix. The offsets inside are what make training exactly-once (see
``grpo_learner.source.GroupSource``): they are the position right after the last group this model state contains.

Integrity: every checkpoint carries a manifest of its files' sha256 (``grpo_learner.manifest``), verified before it
is used. A damaged or incomplete one is logged with the file and the reason, moved aside (``damaged-step-*``, kept
for inspection) and the previous intact one is used: its offsets and dedup position come with it, so exactly-once
holds. Checkpoints exist but none is intact: :class:`CheckpointError` (starting fresh would train every group again).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from grpo_core.config import InputError
from grpo_core.fsutil import fsync_dir
from grpo_core.weights import Payload
from grpo_core.weights.common import write_all
from grpo_learner.manifest import FORMAT, HashingWriter, verify, write_manifest

LATEST = "latest"
log = logging.getLogger(__name__)


class CheckpointError(InputError):
    """A checkpoint that cannot be written or used, with the reason and what to do: one line at the CLI, exit 2
    (an orchestrator restarts the learner, which then resumes from its newest intact checkpoint)."""


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def layout(self) -> str:
        """``classic`` (model/ + trainer.pt, one process) or ``dcp`` (sharded: ``grpo_learner.dist_checkpoint``)."""
        return str(self.meta.get("layout", "classic"))

    def trainer_state(self) -> dict[str, Any]:
        return cast(dict[str, Any], torch.load(self.path / "trainer.pt", map_location="cpu", weights_only=False))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, models: dict[str, dict[str, Payload]], trainer_state: dict[str, Any],
         meta: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically; ``models`` maps a subdirectory name to the files of a HF model
    directory (``grpo_learner.publish``'s ``safetensors_payload`` and ``metadata_payloads``: what
    ``save_pretrained`` writes, one safetensors file rather than shards -- the same file serves the vLLM in-place
    reload and fast restore -- without its ~25 ms of per-call overhead, paid at every publish otherwise). Every file
    is hashed as it is written, for the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    # About the model files plus the previous checkpoint's trainer state (optimizer moments: the bulk of it, and the
    # same size every step): refused before anything is written when it cannot fit.
    needed = sum(p.size for files in models.values() for p in files.values()) + _trainer_bytes(root)
    advice = f"free space there, or move out_dir; keep_checkpoints={keep} keeps that many, plus the one being written"
    if shutil.disk_usage(root).free < needed:
        raise no_space(f"checkpoint step {step}", root, needed, advice)
    tmp.mkdir()
    known = {}
    try:
        for name, files in models.items():
            (tmp / name).mkdir()
            for file_name, payload in files.items():
                with open(tmp / name / file_name, "wb", buffering=0) as raw:  # fsynced by commit()
                    f = HashingWriter(raw)
                    for block in payload.checked_blocks():  # a wrong size: no checkpoint, not one that cannot restore
                        write_all(f, block)  # type: ignore[arg-type]
                known[f"{name}/{file_name}"] = f.entry()
        with open(tmp / "trainer.pt", "wb") as raw:
            f = HashingWriter(raw)
            torch.save(trainer_state, f)  # type: ignore[arg-type]
        known["trainer.pt"] = f.entry()
        return commit(root, tmp, step, meta, keep, known)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise no_space(f"checkpoint step {step}", root, needed, advice) from None
        raise


def _trainer_bytes(root: Path) -> int:
    """Size of the newest checkpoint's trainer.pt (0 before the first)."""
    previous = sorted(root.glob("step-*"))
    trainer = previous[-1] / "trainer.pt" if previous else None
    return trainer.stat().st_size if trainer is not None and trainer.exists() else 0


def no_space(what: str, path: Path, needed: int, advice: str) -> CheckpointError:
    """A full disk in one line: what was being written, where, the space free and needed, and what to change."""
    there = next(p for p in (path, *path.parents) if p.exists())  # the directory may not exist yet
    return CheckpointError(f"{what}: no space left on {path} ({shutil.disk_usage(there).free / 1e9:.2f} GB free, "
                           f"about {needed / 1e9:.2f} GB needed): {advice}")


def temp_dir(root: Path, step: int) -> Path:
    """Where checkpoint ``step`` is assembled before :func:`commit` renames it into place."""
    return root / f".tmp-step-{step:08d}"


def commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], keep: int,
           known: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write ``meta.json`` and the manifest (``known``: entries hashed while writing; the other files are hashed
    here) into the assembled ``tmp``, make it durable, rename it into place, then move ``latest``: the rename is the
    instant the checkpoint exists (the same for the sharded ones, ``dist_checkpoint``)."""
    final = root / f"step-{step:08d}"
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "integrity": FORMAT}, indent=1))
    write_manifest(tmp, known or {})
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same step after a crash: the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(root / LATEST, final.name)
    _gc(root, keep)
    return final


def load_latest(root: Path, repair: bool = False, on_reject: Callable[[Path, str], None] | None = None
                ) -> Checkpoint | None:
    """The newest intact checkpoint under ``root``, or None for a fresh run (no checkpoint at all).

    A damaged or incomplete one is logged with its reason and skipped (``on_reject(path, reason)``); with ``repair``
    (the learner at start-up) it is also moved aside to ``damaged-step-*``, and the leftovers of an interrupted save
    are removed. Raises :class:`CheckpointError` when checkpoints exist but none is intact."""
    if not root.exists():
        return None
    if repair:
        for stale in root.glob(".tmp-step-*"):
            log.info("removing %s: a checkpoint whose save was interrupted", stale)
            shutil.rmtree(stale, ignore_errors=True)
    rejected = []
    for path in _candidates(root):
        reason = check(path)
        if not reason:
            return Checkpoint(path, json.loads((path / "meta.json").read_text()))
        rejected.append(f"{path.name}: {reason}")
        log.warning("checkpoint %s is not used: %s", path, reason)
        if on_reject is not None:
            on_reject(path, reason)
        if repair:
            quarantine(path)
    damaged = sorted(p.name for p in root.glob("damaged-step-*"))
    if rejected or damaged:
        found = "; ".join(rejected) or "damaged: " + ", ".join(damaged)
        raise CheckpointError(f"no intact checkpoint in {root} ({found}): restore one from a backup, or remove the "
                              "directory to train from the start again")
    return None


def _candidates(root: Path) -> list[Path]:
    """Checkpoint directories, the one ``latest`` names first, then newest first."""
    latest = root / LATEST
    named = [root / latest.read_text().strip()] if latest.exists() else []
    steps = sorted(root.glob("step-*"), reverse=True)
    return [p for p in dict.fromkeys(named + steps) if p.is_dir()]


def check(path: Path) -> str:
    """Why checkpoint ``path`` must not be used ("" if it may): its manifest, or for one written before manifests
    existed, that its files are there (such a one is used with a warning: nothing can verify it)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        return "meta.json is missing (an incomplete checkpoint)"
    except ValueError as exc:
        return f"meta.json is unreadable ({exc})"
    if meta.get("integrity") == FORMAT:
        return verify(path)
    if meta.get("layout", "classic") == "classic" and not (path / "trainer.pt").exists():
        return "trainer.pt is missing"
    log.warning("checkpoint %s has no integrity manifest (written by an older version): used unverified", path)
    return ""


def quarantine(path: Path) -> Path:
    """Move a damaged checkpoint out of the way (kept for inspection: delete it when done)."""
    dest = path.with_name(f"damaged-{path.name}")
    if dest.exists():
        dest = path.with_name(f"damaged-{path.name}-{int(time.time())}")
    os.replace(path, dest)
    log.warning("moved the damaged checkpoint to %s", dest)
    return dest


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """"" when every value is finite, else which tensors hold NaN/Inf and how many (weights that must never be
    checkpointed or published: every producer would sample from them)."""
    bad = []
    for name, t in tensors:
        # One reduction per tensor: a NaN or Inf anywhere makes the sum non-finite (cheaper than a mask of the
        # tensor, and this runs at every publish); only then are they counted, which also clears a sum that
        # overflowed on finite values.
        if t.is_floating_point() and not bool(torch.isfinite(t.sum(dtype=torch.float32))):
            count = int((~torch.isfinite(t)).sum())
            if count:
                bad.append(f"{name}: {count}")
    return ", ".join(bad)


def _gc(root: Path, keep: int) -> None:
    for old in sorted(root.glob("step-*"))[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    for stale_tmp in root.glob(".tmp-step-*"):
        shutil.rmtree(stale_tmp, ignore_errors=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


