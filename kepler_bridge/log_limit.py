"""A log line that a flood of the same event writes at most once per interval."""

from __future__ import annotations

import threading
import time
from typing import Protocol

INTERVAL_SECONDS = 60.0


class Warns(Protocol):
    """A logging.Logger, or gunicorn's."""

    def warning(self, msg: str, *args: object) -> None: ...


class EveryInterval:
    """A warning logged at most once per `seconds`, saying how many like it were left out."""

    def __init__(self, log: Warns, message: str, seconds: float = INTERVAL_SECONDS) -> None:
        self.log, self.message, self.seconds = log, message, seconds
        self._lock = threading.Lock()
        self._next = 0.0
        self._left_out = 0

    def warning(self, *args: object) -> bool:
        """Log the message with `args` unless one was logged within the interval; True if it
        was."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._left_out += 1
                return False
            left_out, self._left_out, self._next = self._left_out, 0, now + self.seconds
        more = f" ({left_out} more like it in the last {self.seconds:.0f} s)" if left_out else ""
        self.log.warning(self.message + more, *args)
        return True
