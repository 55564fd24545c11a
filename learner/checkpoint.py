"""Atomic learner checkpoints: model + optimizer + scheduler + RNG + step + the next ``groups`` offsets.

Layout: ``<dir>/step-00000042/{model/model.safetensors, trainer.pt, meta.json}`` and ``<dir>/latest`` naming the
newest one; ``meta.json`` also names the checkpoint's position in the dedup log beside them
(``grpo_learner.seen_log``). A checkpoint is written into a hidden temporary directory, fsynced, then renamed into
place, and only then does ``latest`` move (also by rename): a process killed at any instant leaves either the
previous checkpoint or the new one, never a torn mix. The offsets inside are what make training exactly-once (see
``grpo_learner.source.GroupSource``): they are the position right after the last group this model state contains.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.fsutil import fsync_dir
from grpo_core.weights import Payload
from grpo_core.weights.common import write_all

LATEST = "latest"


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
        return torch.load(self.path / "trainer.pt", map_location="cpu", weights_only=False)


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
    reload and fast restore -- without its ~25 ms of per-call overhead, paid at every publish otherwise)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, files in models.items():
        (tmp / name).mkdir()
        for file_name, payload in files.items():
            with open(tmp / name / file_name, "wb", buffering=0) as f:  # fsynced by commit()
                for block in payload.checked_blocks():  # a wrong size: no checkpoint, not one that cannot restore
                    write_all(f, block)
    torch.save(trainer_state, tmp / "trainer.pt")
    return commit(root, tmp, step, meta, keep)


def temp_dir(root: Path, step: int) -> Path:
    """Where checkpoint ``step`` is assembled before :func:`commit` renames it into place."""
    return root / f".tmp-step-{step:08d}"


def commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Write ``meta.json`` into the assembled ``tmp``, make it durable, rename it into place, then move ``latest``:
    the rename is the instant the checkpoint exists (the same for the sharded ones, ``dist_checkpoint``)."""
    final = root / f"step-{step:08d}"
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same step after a crash: the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(root / LATEST, final.name)
    _gc(root, keep)
    return final


def load_latest(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``, or None for a fresh run."""
    if not root.exists():
        return None
    candidates = []
    latest = root / LATEST
    if latest.exists():
        candidates.append(root / latest.read_text().strip())
    candidates += sorted(root.glob("step-*"), reverse=True)
    for path in candidates:
        meta_file = path / "meta.json"
        if meta_file.exists() and (path / "trainer.pt").exists():
            return Checkpoint(path, json.loads(meta_file.read_text()))
    return None


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


