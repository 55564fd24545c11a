"""Retry with exponential backoff: the one loop every I/O edge (broker calls, weight fetches) goes through.

Inside a process we fail fast; only calls that cross to the broker or to a shared volume are retried, and only
for the exception types the caller names as transient.

A call's retries are logged as its own (:class:`CallLog`: a WARNING per retry, an INFO when it succeeds after
failures). A dependency every call shares (the broker) reports through one :class:`Outage` per process instead,
since an outage makes every call fail at once: one WARNING when it stops answering, one INFO with the outage's
length when it answers again, whatever the number of calls that failed meanwhile.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_DELAY_S = 10.0


class RetryLog(Protocol):
    """Where :func:`retry` reports a failure it is about to retry, and a success."""

    def failed(self, what: str, exc: BaseException, attempt: int, attempts: int, retry_in_s: float) -> None: ...

    def succeeded(self, what: str) -> None: ...


class CallLog:
    """One call's retries: a WARNING per retry (bounded by its attempts), an INFO when it succeeds after failures."""

    def __init__(self) -> None:
        self.failures, self.since = 0, 0.0

    def failed(self, what: str, exc: BaseException, attempt: int, attempts: int, retry_in_s: float) -> None:
        self.failures += 1
        if self.failures == 1:
            self.since = time.monotonic()
        log.warning("%s failed (%s); retry %d/%d in %.2fs", what, describe(exc), attempt, attempts - 1, retry_in_s)

    def succeeded(self, what: str) -> None:
        if self.failures:
            log.info("%s succeeded after %d failed attempt(s), %.1fs", what, self.failures,
                     time.monotonic() - self.since)


class Outage:
    """A dependency every call of the process shares (the broker): one WARNING once calls to it have been failing
    for ``grace_s``, DEBUG for each failure, one INFO with the outage's length at the first success after it.

    An outage is announced only once it has lasted ``grace_s``: a broker whose group coordinator is still
    loading when the process starts fails calls for a second or two, which is no news to anyone (those failures
    stay at DEBUG, and so does the recovery). At most one outage is announced per ``warn_every_s``: a broker
    that flaps while it recovers writes no pair of lines per flap; a later failure within the window is
    announced once the window has passed. Thread-safe: clients fail on several threads at once."""

    def __init__(self, name: str, warn_every_s: float = 60.0, grace_s: float = 5.0) -> None:
        self.name, self.warn_every_s, self.grace_s = name, warn_every_s, grace_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._failures = 0
        self._announced = False
        self._warned_at = -math.inf
        self._last = ""  # the newest failure: "what: error"

    @property
    def down_since(self) -> float | None:
        """time.monotonic() of the first failure of the outage in progress; None while the dependency answers."""
        return self._since

    def failed(self, what: str, exc: BaseException, attempt: int = 0, attempts: int = 0,
               retry_in_s: float = 0.0) -> None:
        now = time.monotonic()
        with self._lock:
            self._last = f"{what}: {describe(exc)}"
            if self._since is None:
                self._since, self._failures = now, 0
                if self.grace_s > 0:  # calls may back off or block past the grace: a timer says it on time
                    timer = threading.Timer(self.grace_s, self._announce, args=(now,))
                    timer.daemon = True
                    timer.start()
            self._failures += 1
        if not self._announce(self._since):
            log.debug("%s still not answering (%s)", self.name, self._last)

    def _announce(self, since: float | None) -> bool:
        """The outage's one WARNING, once it has lasted ``grace_s``: True if this call said it."""
        now = time.monotonic()
        with self._lock:
            down_s = now - since if since is not None and since == self._since else -1.0
            announce = (down_s >= self.grace_s and not self._announced
                        and now - self._warned_at >= self.warn_every_s)
            if announce:
                self._announced, self._warned_at = True, now
            last = self._last
        if announce:
            log.warning("%s is not answering (%s; for %.1fs); retrying, further failures at DEBUG until it answers",
                        self.name, last, down_s)
        return announce

    def succeeded(self, what: str = "") -> None:
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            since, failures, announced = self._since, self._failures, self._announced
            self._since, self._announced = None, False
        if since is not None:
            log.log(logging.INFO if announced else logging.DEBUG, "%s answers again after %.1fs (%d failed calls)",
                    self.name, time.monotonic() - since, failures)


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line (kafka-python's errors already name their type in their str())."""
    text, name = " ".join(str(exc).split()), type(exc).__name__
    return text if name in text else f"{name}: {text}" if text else name


def backoff_delay(attempt: int, backoff_s: float, max_delay_s: float = MAX_DELAY_S) -> float:
    """Delay before retry number ``attempt`` (1-based): ``backoff_s * 2**(attempt-1)``, capped."""
    delay: float = backoff_s * 2 ** (attempt - 1)  # int ** int is Any to mypy (a negative power is a float)
    return min(delay, max_delay_s)


def retry(fn: Callable[[], T], what: str, *, attempts: int, backoff_s: float,
          transient: tuple[type[BaseException], ...], fatal: tuple[type[BaseException], ...] = (),
          give_up: Callable[[], bool] | None = None, until: float | None = None,
          log_to: RetryLog | None = None) -> T:
    """Call ``fn`` up to ``attempts`` times, sleeping with exponential backoff after a ``transient`` failure;
    the last failure (or any other exception) propagates unchanged. ``fatal``: subclasses of a transient type
    that no retry can heal (a refused login), raised at once. ``give_up``: asked after each failure and while
    waiting; True means the result is no longer wanted (a newer weight version was announced), and the last
    failure propagates at once instead of being retried. ``until``: a time.monotonic() deadline no backoff
    sleeps past; a failure at or after it propagates. ``log_to``: where failures and the success are reported
    (default: a :class:`CallLog` of this call)."""
    notes = log_to if log_to is not None else CallLog()
    for attempt in range(1, attempts + 1):
        try:
            result = fn()
        except transient as exc:
            if attempt == attempts or isinstance(exc, fatal) or (give_up is not None and give_up()):
                raise
            delay = backoff_delay(attempt, backoff_s)
            if until is not None:
                left = until - time.monotonic()
                if left <= 0:
                    raise
                delay = min(delay, left)
            notes.failed(what, exc, attempt, attempts, delay)
            if _wait(delay, give_up):
                raise
        else:
            notes.succeeded(what)
            return result
    raise AssertionError("unreachable: attempts must be >= 1")


def _wait(delay: float, give_up: Callable[[], bool] | None, slice_s: float = 0.1) -> bool:
    """Sleep ``delay`` seconds, asking ``give_up`` every ``slice_s``; whether it said to give up."""
    if give_up is None:
        time.sleep(delay)
        return False
    deadline = time.monotonic() + delay
    while (left := deadline - time.monotonic()) > 0:
        if give_up():
            return True
        time.sleep(min(slice_s, left))
    return give_up()
