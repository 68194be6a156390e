"""Who goes first in the worker: the event loop answering requests, before the sampler."""

from __future__ import annotations

import threading

# The longest the sampler waits at one checkpoint: a loop kept busy for ever must not stop samples.
MOST_WAIT_SECONDS = 0.002


class Turns:
    """Marks the event loop busy from a wake-up until it is back in select. The threads that
    `defer` (the sampler, the anomaly thread) wait at each `give_way` while the loop is busy, off
    the GIL, instead of sharing the interpreter with a request half answered; the HTTP pool and the
    loop itself never wait."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._deferring: set[int] = set()

    def defer(self) -> None:
        """Have the calling thread wait at its `give_way` calls while the loop is busy."""
        self._deferring.add(threading.get_ident())

    def serving(self) -> None:
        """The event loop woke with events to handle."""
        self._idle.clear()

    def served(self) -> None:
        """The event loop handled them and goes back to select."""
        self._idle.set()

    def give_way(self) -> None:
        """Between two steps of work: in a deferring thread, wait while the event loop is busy (at
        most MOST_WAIT_SECONDS)."""
        if not self._idle.is_set() and threading.get_ident() in self._deferring:
            self._idle.wait(MOST_WAIT_SECONDS)


TURNS = Turns()
