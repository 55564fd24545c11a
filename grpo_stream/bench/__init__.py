"""Benchmarks: scripts that measure and print figures (never timed tests)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def temporary_broker(bootstrap: str | None) -> Iterator[str]:
    """An external bootstrap as given, or a throwaway local broker for the duration of a benchmark."""
    if bootstrap:
        yield bootstrap
        return
    from grpo_stream.broker import LocalBroker, free_port

    with tempfile.TemporaryDirectory(prefix="grpo-bench-kafka-") as tmp:
        broker = LocalBroker(data_dir=Path(tmp), port=free_port(), controller_port=free_port())
        try:
            yield broker.up(fresh=True)["bootstrap"]
        finally:
            broker.down()
