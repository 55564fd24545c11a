"""Retry with exponential backoff: the one loop every I/O edge (broker calls, weight fetches) goes through.

Inside a process we fail fast; only calls that cross to the broker or to a shared volume are retried, and only
for the exception types the caller names as transient.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_DELAY_S = 10.0


def backoff_delay(attempt: int, backoff_s: float, max_delay_s: float = MAX_DELAY_S) -> float:
    """Delay before retry number ``attempt`` (1-based): ``backoff_s * 2**(attempt-1)``, capped."""
    return min(backoff_s * 2 ** (attempt - 1), max_delay_s)


def retry(fn: Callable[[], T], what: str, *, attempts: int, backoff_s: float,
          transient: tuple[type[BaseException], ...], fatal: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``fn`` up to ``attempts`` times, sleeping with exponential backoff after a ``transient`` failure;
    the last failure (or any other exception) propagates unchanged. ``fatal``: subclasses of a transient type
    that no retry can heal (a refused login), raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except transient as exc:
            if attempt == attempts or isinstance(exc, fatal):
                raise
            delay = backoff_delay(attempt, backoff_s)
            log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__, exc,
                        attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: attempts must be >= 1")
