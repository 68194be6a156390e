"""Who goes first in the worker: the event loop answering requests, before the sampler."""

from __future__ import annotations

import threading

# The longest the sampler waits at one checkpoint: a loop kept busy for ever must not stop samples.
MOST_WAIT_SECONDS = 0.002


class Turns:
    """Marks the event loop busy from a wake-up until it is back in select. The sampler and the
    anomaly thread call `give_way` between steps: while the loop is busy they wait there, off the
    GIL, instead of sharing the interpreter with a request half answered."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._loop = 0

    def serving(self) -> None:
        """The event loop woke with events to handle."""
        self._loop = threading.get_ident()
        self._idle.clear()

    def served(self) -> None:
        """The event loop handled them and goes back to select."""
        self._idle.set()

    def give_way(self) -> None:
        """Between two steps of background work: wait while the event loop is busy (at most
        MOST_WAIT_SECONDS); never in the loop's own thread."""
        if not self._idle.is_set() and threading.get_ident() != self._loop:
            self._idle.wait(MOST_WAIT_SECONDS)


TURNS = Turns()
