"""A file to publish that is not on disk: ``size`` bytes produced in order by ``blocks()``.

Why: the learner's publish used to save the model to a temporary directory and then copy that file into the store
(the fs store) or read it back in chunks (the kafka store), hashing it on the way: two extra passes over every
byte. A :class:`Payload` lets the learner serialise its state dict straight into the store's file or chunk
records, hashed as it is written (``grpo_learner.publish``). Stores read a payload and a file the same way,
through :func:`open_source`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

Block = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Payload:
    """``size`` bytes, produced by ``blocks()`` (called once per publication; blocks of any length)."""

    size: int
    blocks: Callable[[], Iterable[Block]]

    @staticmethod
    def of_bytes(data: bytes) -> Payload:
        return Payload(len(data), lambda: (data,))

    def checked_blocks(self) -> Iterator[Block]:
        """``blocks()``, raising OSError once they run past ``size`` or end short of it: a serialiser bug fails
        the write instead of leaving a file of another size than announced (stores and checkpoints alike)."""
        done = 0
        for block in self.blocks():
            done += memoryview(block).nbytes
            if done > self.size:
                raise OSError(f"payload produced {done} bytes, announced {self.size}")
            yield block
        if done != self.size:
            raise OSError(f"payload produced {done} bytes, announced {self.size}")


class _BlockReader(io.RawIOBase):
    """A readable stream over a payload's blocks; refuses to end early or run long (``checked_blocks``)."""

    def __init__(self, payload: Payload) -> None:
        self._blocks: Iterator[Block] = payload.checked_blocks()
        self._view = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Block) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        n = 0
        while n < len(out):
            if not self._view:
                block = next(self._blocks, None)
                if block is None:
                    break
                self._view = memoryview(block).cast("B")
            k = min(len(out) - n, len(self._view))
            out[n:n + k] = self._view[:k]
            self._view, n = self._view[k:], n + k
        return n


def open_source(src: Path | Payload) -> tuple[io.RawIOBase, int]:
    """A readable binary stream and its size, for a file on disk or a payload."""
    if isinstance(src, Payload):
        return _BlockReader(src), src.size
    f = open(src, "rb", buffering=0)  # noqa: SIM115 -- the caller closes it
    return f, os.fstat(f.fileno()).st_size
