"""Chunk records of the ``kafka`` weight store: decoding, and reassembling one version into a file.

:class:`ChunkAssembler` writes a version's chunks in index order and hashes them on the way (no second pass);
:class:`_ChunkWriter` runs the disk write and the sha256 on two threads of their own, so both overlap the
receive of the next chunks. The download (:mod:`grpo_core.weights.kafka`) and the stream
(:mod:`grpo_core.weights.stream`) both assemble through it.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from typing import BinaryIO, cast

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import Consumer, Record, make_consumer
from grpo_core.weights.common import MiB, WeightFetchError, write_all

log = logging.getLogger("grpo_core.weights")


def chunk_consumer(kafka: KafkaConfig, role: str) -> Consumer:
    """A group-less consumer whose fetches hold several multi-MiB chunk records."""
    fetch_bytes = max(kafka.max_record_bytes, 48 * MiB)
    return make_consumer(kafka, role, None, max_partition_fetch_bytes=fetch_bytes, fetch_max_bytes=fetch_bytes)


class _ChunkWriter:
    """Writes chunks to ``out`` and hashes them, in order, on two threads of its own: the disk write and the
    sha256 (both release the GIL) of earlier chunks overlap each other and the receive and decode of the next
    chunk. At most ``depth`` chunks wait in memory per thread."""

    def __init__(self, out: BinaryIO, depth: int = 4) -> None:
        self.out, self.hasher, self.error = out, hashlib.sha256(), cast(OSError | None, None)
        self._queues: list[queue.Queue[bytes | None]] = [queue.Queue(maxsize=depth), queue.Queue(maxsize=depth)]
        self._threads = [threading.Thread(target=self._write, name="weights-writer", daemon=True),
                         threading.Thread(target=self._hash, name="weights-hasher", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _write(self) -> None:
        while (data := self._queues[0].get()) is not None:
            if self.error is None:  # after a failed write, drain the queue so put() never blocks forever
                try:
                    write_all(self.out, data)
                except OSError as exc:
                    self.error = exc

    def _hash(self) -> None:
        while (data := self._queues[1].get()) is not None:
            self.hasher.update(data)

    def put(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        for q in self._queues:
            q.put(data)

    def close(self) -> None:
        """Wait until everything queued is written (or dropped after an error) and hashed; idempotent."""
        for q, thread in zip(self._queues, self._threads, strict=True):
            if thread.is_alive():
                q.put(None)
                thread.join()

    def finish(self) -> str:
        """The sha256 of everything written; raises the write error, if there was one."""
        self.close()
        if self.error is not None:
            raise self.error
        return self.hasher.hexdigest()


class ChunkAssembler:
    """Writes one version's chunks in index order to ``out``, hashing as it goes (no second pass).

    A chunk 0 after progress restarts the assembly (an earlier, abandoned publication of the same version seen by
    a timestamp scan, or a learner re-publishing after a crash); older indices are duplicates and skipped; a jump
    forward means chunks are missing. ``max_bytes`` (the announced size, when known) caps what is written. The
    write and hash run on :class:`_ChunkWriter` threads: use the assembler as a context manager (or call
    :meth:`close`) so they end, and :meth:`finish` / :meth:`verify` for the result.
    """

    def __init__(self, run: str, version: int, num_chunks: int, out: BinaryIO, max_bytes: int | None = None) -> None:
        self.run, self.version, self.num_chunks, self.out, self.max_bytes = run, version, num_chunks, out, max_bytes
        self.writer: _ChunkWriter | None = None
        self._reset()

    def __enter__(self) -> ChunkAssembler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reset(self) -> None:
        self.close()
        self.out.seek(0)  # overwritten from the start, cut to size by finish(): ``out`` may be a pre-filled spare
        self.next_index, self.size, self.writer = 0, 0, _ChunkWriter(self.out)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def complete(self) -> bool:
        return self.next_index == self.num_chunks

    def add(self, msg: Record) -> None:
        self.add_chunk(decode_chunk(msg), f"{msg.topic}[{msg.partition}]@{msg.offset}")

    def add_chunk(self, chunk: wire.WeightChunk, where: str) -> None:
        if (chunk.run, chunk.version) != (self.run, self.version):
            raise WeightFetchError(f"chunk at {where} is {chunk.run!r} v{chunk.version}, keyed as this version")
        if chunk.num_chunks != self.num_chunks:
            log.warning("weights: skipping chunk at %s: part of a %d-chunk publication, expected %d", where,
                        chunk.num_chunks, self.num_chunks)
            return
        if chunk.index == 0 and self.next_index > 0:
            self._reset()
        if chunk.index < self.next_index:
            return
        if chunk.index > self.next_index:
            raise WeightFetchError(f"chunk {chunk.index} at {where} follows chunk {self.next_index - 1}: "
                                   f"chunks {self.next_index}..{chunk.index - 1} are missing")
        if self.max_bytes is not None and self.size + len(chunk.data) > self.max_bytes:
            raise WeightFetchError(f"chunks add up to more than the announced {self.max_bytes} bytes")
        assert self.writer is not None
        self.writer.put(chunk.data)
        self.size += len(chunk.data)
        self.next_index += 1

    def finish(self) -> str:
        """Wait for the writes and cut ``out`` to what was written; the sha256 of what was assembled."""
        assert self.writer is not None
        digest = self.writer.finish()
        self.out.truncate(self.size)
        return digest

    def verify(self, ann: wire.WeightsAnnouncement) -> None:
        """Kafka records are immutable and CRC-checked: a mismatch here will not heal by retrying."""
        digest = self.finish()
        if self.size != ann.size_bytes:
            raise WeightFetchError(f"size mismatch: reassembled {self.size} bytes, announced {ann.size_bytes}")
        if digest != ann.sha256:
            raise WeightFetchError(f"sha256 mismatch: reassembled file hashes to {digest}, announced {ann.sha256}")


def decode_chunk(msg: Record) -> wire.WeightChunk:
    try:
        return wire.decode(msg.value, wire.WeightChunk)
    except wire.WireError as exc:
        raise WeightFetchError(f"undecodable chunk at {msg.topic}[{msg.partition}]@{msg.offset}: {exc}") from None

