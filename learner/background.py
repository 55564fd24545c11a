"""Saving off the learner's critical path: a background worker per kind of save, and reusable snapshot buffers.

A publish or a checkpoint is two parts. The *snapshot* runs on the learner's thread: the state to save is copied
into buffers this module keeps from one save to the next (a device-to-host copy into pinned memory on a GPU, a
memcpy on CPU; published weights are cast to the dtype the producers load). The *write* -- serialise, hash, write
or upload, announce or commit -- runs on a :class:`Worker` thread while the learner trains the next steps.

One save of a kind is in flight at a time (the buffers are reused, and a store or the disk is not made faster by
two writers): a save that comes while the previous one is still writing waits for it, or (publishes, with
``publish_overlap: skip``) is not made. An error in the background is kept and raised on the learner's thread at
its next :meth:`Worker.check` -- after every step -- as that step's error: never lost, never retried here (the
stores retry their own I/O).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class Worker:
    """Runs one job at a time on a thread of its own; the job's exception is re-raised by :meth:`check`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        """Start ``job`` in the background; the previous job must have finished (:meth:`wait` first)."""
        if self.busy():
            raise RuntimeError(f"{self.name}: a job is still running")
        self.check()

        def run() -> None:
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 -- kept for the learner's thread, which raises it
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"learner-{self.name}", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the job in flight (if any) has finished; returns the seconds waited. Raises its error."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
        return time.perf_counter() - t0

    def join(self) -> None:
        """Block until the job in flight (if any) has finished, from any thread; its error stays for :meth:`check`."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def check(self) -> None:
        """Raise the error of a finished job, once."""
        if self._error is not None and not self.busy():
            error, self._error = self._error, None
            raise error


class Buffers:
    """Host copies of tensors, allocated once per name/shape/dtype and written over at every snapshot.

    :meth:`copy` takes a nested structure of dicts/lists/tuples with tensors at the leaves (a state dict, an
    optimizer's ``state_dict()``) and returns the same structure with every tensor replaced by its buffer, so the
    originals may change as soon as it returns. ``dtype`` casts floating-point tensors (the published dtype)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def copy(self, tree: Any, dtype: torch.dtype | None = None, prefix: str = "") -> Any:
        if isinstance(tree, torch.Tensor):
            return self._tensor(prefix, tree, dtype)
        if isinstance(tree, dict):
            return {k: self.copy(v, dtype, f"{prefix}/{k}") for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self.copy(v, dtype, f"{prefix}/{i}") for i, v in enumerate(tree))
        return tree

    def _tensor(self, key: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != want:
            if buf is not None:
                self.bytes -= buf.numel() * buf.element_size()
            buf = torch.empty(t.shape, dtype=want, device="cpu", pin_memory=t.is_cuda)
            self._buffers[key] = buf
            self.bytes += buf.numel() * buf.element_size()
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        return buf

    def sync(self) -> None:
        """Wait for non-blocking device-to-host copies (before a worker reads the buffers)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
