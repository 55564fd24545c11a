"""The receivers' chunk stream: assemble kafka-store versions *while the learner publishes them*.

Without it a producer starts reading a version's chunks when the announcement arrives, i.e. after the whole
upload, and the swap takes as long as a full download. With it (``weights.kafka.stream``, the producers'
default) a swap only waits for the last chunks after the announcement. Between versions a spare file of the last
version's size is filled with zeros, so the next version overwrites pages already in the page cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from grpo_core import wire
from grpo_core.config import KafkaConfig
from grpo_core.kafka_io import Partition, Record, poll, require_partitions, with_retry
from grpo_core.weights.chunks import ChunkAssembler, chunk_consumer, decode_chunk
from grpo_core.weights.common import (
    IO_BYTES,
    STALL_S,
    WeightFetchError,
    check_run_name,
    parse_kafka_location,
    version_dir_name,
)

log = logging.getLogger("grpo_core.weights")


@dataclass
class _Streamed:
    """A version the stream has assembled (or is assembling): where chunk 0 was, the file, what it hashes to."""

    version: int
    partition: int
    first_offset: int
    path: Path
    size: int = 0
    sha256: str = ""


class _Spare:
    """A file of zeros the stream writes ahead of the next version, so that the version's bytes overwrite pages
    already in the page cache instead of allocating them while the upload is running (measured here: overwriting
    1 GB costs 0.1-0.3 s of kernel time during an upload, writing it afresh 0.3-2 s). Filled on a thread of its
    own between versions; :meth:`take` stops the filling wherever it got to. Only ever a head start: a short,
    failed or vanished spare just means more fresh pages."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size, self._stop = path, size, threading.Event()
        self._thread = threading.Thread(target=self._fill, name="weights-spare", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        zeros = memoryview(bytes(IO_BYTES))
        try:
            with open(self.path, "wb", buffering=0) as f:
                done = 0
                while done < self.size and not self._stop.is_set():
                    done += f.write(zeros[:min(IO_BYTES, self.size - done)])
        except OSError as exc:
            log.warning("weights stream: spare file %s: %s (the next version is written afresh)", self.path, exc)

    def take(self) -> Path:
        """Stop filling; the file is the caller's now (it may be short, or missing if the fill failed)."""
        self._stop.set()
        self._thread.join()
        return self.path

    def discard(self) -> None:
        self.take().unlink(missing_ok=True)


class ChunkStream:
    """Assembles a run's kafka-store versions *while the learner publishes them*, on a background thread.

    Without it a producer starts reading a version's chunks when the announcement arrives, i.e. after the whole
    upload, and the swap takes as long as a full download. The stream tails the weight-data topic from the
    moment it starts; when an announcement arrives, :meth:`take` only waits for the last chunks and checks the
    size and sha256 the stream computed while writing. It keeps one version in progress (a newer chunk 0
    abandons an older partial) and one finished version; anything it cannot vouch for (a version whose chunk 0
    came before the stream started, a stall, a mismatch, a broken stream) makes :meth:`take` return False and
    the fetcher downloads the version itself. Costs: one consumer thread (plus a writer and a hasher thread
    while a version is in progress), a copy of every version on disk, and between versions a :class:`_Spare`
    of the last version's size.
    """

    def __init__(self, kafka: KafkaConfig, topic: str, run: str, cache_dir: Path) -> None:
        self.run, self.prefix, self.dir = check_run_name(run), f"{run}/".encode(), Path(cache_dir) / run
        self.consumer = chunk_consumer(kafka, "weights-stream")
        parts = with_retry(lambda: require_partitions(self.consumer, topic), f"weights stream: metadata of {topic}")
        tps = [Partition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        self.start = {tp.partition: self.consumer.position(tp) for tp in tps}  # everything from here is seen
        self.positions = dict(self.start)
        self.current: tuple[_Streamed, ChunkAssembler] | None = None  # the assembler's ``out`` is the open file
        self.done: _Streamed | None = None
        self.spare: _Spare | None = None  # prepared after each version, sized like it, for the next one
        self.hits, self.spares_used, self.failed, self._stop = 0, 0, "", False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="weights-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop:
                for tp, msgs in poll(self.consumer, 200).items():
                    for msg in msgs:
                        if msg.key is not None and msg.key.startswith(self.prefix):
                            self._feed(msg)
                    with self.cond:
                        self.positions[tp.partition] = msgs[-1].offset + 1
                        self.cond.notify_all()
        except Exception as exc:  # the fetcher falls back to downloading; a broken stream must not stop a producer
            log.warning("weights stream stopped (fetches download whole versions from now on): %s", exc)
            with self.cond:
                self.failed = f"{type(exc).__name__}: {exc}"
                self.cond.notify_all()

    def _feed(self, msg: Record) -> None:
        try:
            version = int(msg.key[len(self.prefix):])
        except ValueError:
            return
        where = f"{msg.topic}[{msg.partition}]@{msg.offset}"
        current = self.current
        if current is not None and version < current[0].version:
            return
        try:
            chunk = decode_chunk(msg)
            if current is None or version > current[0].version or chunk.index == 0:  # chunk 0: (re)start
                if chunk.index != 0:
                    return  # joined in the middle of this publication: the fetcher downloads it
                current = self._begin(version, msg, chunk.num_chunks)
            streamed, assembler = current
            assembler.add_chunk(chunk, where)
            if not assembler.complete:
                return
            streamed.size, streamed.sha256 = assembler.size, assembler.finish()
        except (WeightFetchError, OSError) as exc:  # this version only: the fetcher downloads it instead
            log.warning("weights stream: dropping v%d: %s", version, exc)
            self._abandon()
            return
        assembler.out.close()
        # Before the version is handed over, so that whoever takes it finds the next one's spare under way.
        self.spare = _Spare(self.dir / f".stream-spare-{uuid.uuid4().hex[:8]}.part", streamed.size)
        with self.cond:
            if self.done is not None:
                self.done.path.unlink(missing_ok=True)
            self.done, self.current = streamed, None
            self.cond.notify_all()

    def _begin(self, version: int, msg: Record, num_chunks: int) -> tuple[_Streamed, ChunkAssembler]:
        self._abandon()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f".stream-{version_dir_name(version)}-{uuid.uuid4().hex[:8]}.part"
        out: BinaryIO | None = None
        if self.spare is not None:
            spare, self.spare = self.spare.take(), None
            with contextlib.suppress(OSError):  # gone (a GC sweep, a failed fill): start afresh
                os.rename(spare, path)
                out = open(path, "r+b", buffering=0)  # noqa: SIM115 -- closed when complete or abandoned
                self.spares_used += 1
        if out is None:
            out = open(path, "wb", buffering=0)  # noqa: SIM115 -- closed when complete or abandoned
        streamed = _Streamed(version, msg.partition, msg.offset, path)
        self.current = (streamed, ChunkAssembler(self.run, version, num_chunks, out))
        return self.current

    def _abandon(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current[1].out.close()
            self.current[0].path.unlink(missing_ok=True)
            self.current = None

    def take(self, ann: wire.WeightsAnnouncement, dest: Path) -> bool:
        """Move the announced version to ``dest`` if the stream assembled exactly it; False: download it."""
        try:
            _, partition, offset = parse_kafka_location(ann.location)
        except ValueError:
            return False
        if partition is None or offset is None or offset < self.start.get(partition, offset + 1):
            return False
        found = self._wait_for(ann.version, partition, offset)
        if found is None:
            return False
        if (found.size, found.sha256) != (ann.size_bytes, ann.sha256):
            log.warning("weights stream: v%d does not match its announcement; downloading it", ann.version)
            found.path.unlink(missing_ok=True)
            return False
        os.replace(found.path, dest)
        self.hits += 1
        return True

    def _wait_for(self, version: int, partition: int, offset: int) -> _Streamed | None:
        """The finished version whose chunk 0 was at ``offset``, waiting while the stream still makes progress."""
        with self.cond:
            seen, stall_at = self.positions[partition], time.monotonic() + STALL_S
            while True:
                done, current = self.done, self.current
                if done is not None and (done.version, done.partition, done.first_offset) == (
                        version, partition, offset):
                    self.done = None
                    return done
                on_it = current is not None and (current[0].version, current[0].first_offset) == (version, offset)
                if self.failed or self._stop or (self.positions[partition] > offset and not on_it):
                    return None
                if self.positions[partition] != seen:
                    seen, stall_at = self.positions[partition], time.monotonic() + STALL_S
                elif time.monotonic() > stall_at:
                    return None
                self.cond.wait(0.2)

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=10)
        self.consumer.close()
        self._abandon()
        if self.spare is not None:
            self.spare.discard()
        if self.done is not None:
            self.done.path.unlink(missing_ok=True)
