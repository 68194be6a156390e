"""Who goes first in the worker: the event loop answering requests, before the sampler."""

from __future__ import annotations

import logging
import os
import resource
import select
import threading
from contextlib import contextmanager
from typing import Iterator

from kepler_bridge import capabilities

log = logging.getLogger(__name__)

# The longest the sampler waits at one checkpoint: a loop kept busy for ever must not stop samples.
MOST_WAIT_SECONDS = 0.002
# A round of work (a sample, a snapshot's detection) is starved when it waited for a CPU longer
# than this and STARVED_RATIO times the CPU time it got: a thread sharing a CPU equally waits about
# 1x, one under SCHED_IDLE beside a busy thread of normal policy some 300x.
STARVED_SECONDS = 0.05
STARVED_RATIO = 4.0
# RLIMIT_NICE lets a thread lower its nice value to 20 less the limit: 20 allows nice 0, the value
# a thread under SCHED_IDLE needs to come back to SCHED_OTHER, and nothing below it.
NICE_ZERO_LIMIT = 20


class Turns:
    """Marks the event loop busy from a wake-up until it is back in select. The threads that
    `defer` (the sampler, the anomaly thread) wait at each `give_way` while the loop is busy, off
    the GIL, instead of sharing the interpreter with a request half answered; the HTTP pool and the
    loop itself never wait. The loop's selector, where it is `watch`ed, tells them also of events
    the loop was woken for but cannot mark yet: it waits for the GIL they hold.

    Deferring threads also run under SCHED_IDLE, so that a woken event loop takes a CPU from them at
    once instead of queueing behind them (measured: 4 ms of a scrape's 4.5 ms). Within a container's
    CPU cgroup that yields only to the agent's own threads; where the node starves them `check`
    brings every thread back to SCHED_OTHER."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()
        self._round = threading.Event()  # set at each return to select
        self._deferring: set[int] = set()
        self.lowering = True  # False once a starved thread brought all back: none goes again
        self._cpu: dict[int, tuple[float, float]] = {}
        self._lowered: set[int] = set()  # the deferring threads SCHED_IDLE was tried for
        self._events: select.poll | None = None
        # Held while looking at _events: a poll releases the GIL, and a select.poll object polled
        # from a second thread meanwhile raises RuntimeError (the sampler and the anomaly thread
        # both give way).
        self._looking = threading.Lock()

    def watch(self, selector_fd: int) -> None:
        """Tell deferring threads of the events pending in the loop's epoll selector `selector_fd`
        (level-triggered: looking leaves them to the loop)."""
        self._events = select.poll()
        self._events.register(selector_fd, select.POLLIN)

    def defer(self) -> None:
        """Have the calling thread wait at its `give_way` calls while the loop is busy."""
        self._deferring.add(threading.get_ident())
        self._cpu[threading.get_ident()] = cpu_seconds()

    def check(self) -> None:
        """Once per round of a deferring thread's work: after its first round (the first sample,
        which readiness waits for, runs as it always did) it goes under SCHED_IDLE where it can
        return to SCHED_OTHER; where it was starved of a CPU since its last check
        (STARVED_SECONDS, STARVED_RATIO), all threads return to SCHED_OTHER for good."""
        ident = threading.get_ident()
        ran, queued = now = cpu_seconds()
        ran_before, queued_before = self._cpu.get(ident, now)
        self._cpu[ident] = now
        waited = queued - queued_before
        if not self.lowering:
            return
        if waited > max(STARVED_SECONDS, STARVED_RATIO * (ran - ran_before)):
            self.lowering = False
            restored = restore_normal_policy()
            log.warning(
                "a background thread waited %.3f s for a CPU in one round of work: %d thread(s) "
                "leave SCHED_IDLE and share the CPU as any other from now on",
                waited,
                restored,
            )
        elif ident not in self._lowered:
            self._lowered.add(ident)
            if may_return_to_normal():
                _set_policy(os.SCHED_IDLE)  # fails only under a seccomp profile that denies it

    def serving(self) -> None:
        """The event loop woke with events to handle."""
        self._idle.clear()

    def served(self) -> None:
        """The event loop handled them and goes back to select."""
        self._idle.set()
        if not self._round.is_set():
            self._round.set()

    def give_way(self) -> None:
        """Between two steps of work: in a deferring thread, wait while the event loop is busy or
        has events pending (at most MOST_WAIT_SECONDS)."""
        if threading.get_ident() not in self._deferring:
            return
        if not self._idle.is_set():
            self._idle.wait(MOST_WAIT_SECONDS)
        elif self._pending():
            self._round.clear()
            # Still unread after the clear: the loop's return to select after handling them sets
            # it again. Read meanwhile: the loop is past them, and marked busy if not done.
            if self._pending():
                self._round.wait(MOST_WAIT_SECONDS)

    def _pending(self) -> bool:
        """Whether the watched selector has events the loop has not read (False unwatched)."""
        events = self._events
        if events is None:
            return False
        with self._looking:
            return bool(events.poll(0))


@contextmanager
def normal_children() -> Iterator[None]:
    """Around starting a child process: a thread under SCHED_IDLE, whose policy every child would
    inherit, is under SCHED_OTHER meanwhile, so commands and helpers run as they always did."""
    lowered = os.sched_getscheduler(0) == os.SCHED_IDLE
    if lowered:
        _set_policy(os.SCHED_OTHER)
    try:
        yield
    finally:
        if lowered and TURNS.lowering:
            _set_policy(os.SCHED_IDLE)


def _set_policy(policy: int) -> None:
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as err:
        log.debug("cannot set the CPU policy of a thread to %d: %s", policy, err)


class _Schedstat:
    """The calling thread's /proc/thread-self/schedstat, opened once and closed when the thread
    ends and drops it: after a second asleep, opening it took some 150 µs of CPU, reading it again
    from the start 30."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)

    def __del__(self) -> None:
        os.close(self.fd)


_THREAD = threading.local()


def cpu_seconds() -> tuple[float, float]:
    """The calling thread's seconds on a CPU and on a run queue, runnable but not running (its
    /proc/thread-self/schedstat); zeros where the kernel does not tell."""
    try:
        stat = getattr(_THREAD, "schedstat", None)
        if stat is None:
            stat = _THREAD.schedstat = _Schedstat()
        ran, queued = os.pread(stat.fd, 128, 0).split()[:2]
        return int(ran) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def may_return_to_normal() -> bool:
    """Whether a thread of this process under SCHED_IDLE may come back to SCHED_OTHER: a soft
    RLIMIT_NICE that allows nice 0, CAP_SYS_NICE, or a limit raised to nice 0 where the hard limit
    or CAP_SYS_RESOURCE permits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    if _allows_nice_zero(soft) or (capabilities.effective() or 0) & capabilities.SYS_NICE:
        return True
    try:
        new_hard = hard if _allows_nice_zero(hard) else NICE_ZERO_LIMIT
        resource.setrlimit(resource.RLIMIT_NICE, (NICE_ZERO_LIMIT, new_hard))
        return True
    except (ValueError, OSError):
        return False


def _allows_nice_zero(limit: int) -> bool:
    return limit == resource.RLIM_INFINITY or limit >= NICE_ZERO_LIMIT


def restore_normal_policy() -> int:
    """Every thread of this process under SCHED_IDLE back to SCHED_OTHER (threads a deferring
    thread started inherited its policy); how many were."""
    restored = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                restored += 1
        except (ProcessLookupError, PermissionError):
            continue  # ended meanwhile; or not permitted after all: it stays as it is
    return restored


TURNS = Turns()
