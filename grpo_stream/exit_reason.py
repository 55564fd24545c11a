"""Why a supervised child exited, read from its output: the line an operator needs, not the traceback's header.

A child's output is scanned line by line as it is pumped to its log file; the last line that says what went wrong
is kept: the exception line a traceback ends with (``KeyError: 'x'``, not ``Traceback (most recent call last):``),
a log line at ERROR or CRITICAL, or the CLI's one-line ``grpo-stream <role>: error: ...``.
"""

from __future__ import annotations

import re
import signal

MAX_CHARS = 400  # a reason is one terminal line or two; the whole output is in the child's log file

_LOG_ERROR = re.compile(r" (ERROR|CRITICAL) ")
_CLI_ERROR = re.compile(r"^grpo-stream [\w-]+: error: ")
_TRACEBACK = "Traceback (most recent call last):"


class LastError:
    """The last error line seen in one child's output (:meth:`feed` every line; :meth:`reset` at a start)."""

    def __init__(self) -> None:
        self.line = ""
        self._in_traceback = False

    def reset(self) -> None:
        self.line, self._in_traceback = "", False

    def feed(self, line: str) -> None:
        text = line.rstrip("\n")
        if text.startswith(_TRACEBACK):
            self._in_traceback = True
            return
        if self._in_traceback:
            if text[:1].isspace() or not text:  # a frame, its source line, or a caret marker
                return
            self._in_traceback = False  # the first unindented line ends the traceback: the exception itself
            self.line = text
            return
        if _LOG_ERROR.search(text) or _CLI_ERROR.match(text):
            self.line = text

    def reason(self, returncode: int) -> str:
        """One line: the last error line, else what the exit code says (a signal's name)."""
        if self.line:
            return self.line if len(self.line) <= MAX_CHARS else self.line[:MAX_CHARS] + " ..."
        if returncode < 0:
            try:
                return f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                return f"killed by signal {-returncode}"
        return "no error line in its output"
