"""The sample gives way to the event loop: `Turns` between threads, and in the real worker."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from kepler_bridge import turns
from kepler_bridge.turns import Turns

ROOT = Path(__file__).resolve().parent.parent


def _waited_in_thread(t: Turns) -> threading.Thread:
    done = threading.Event()
    thread = threading.Thread(target=lambda: (t.defer(), t.give_way(), done.set()))
    thread.done = done  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_background_work_waits_while_the_loop_serves_and_goes_on_when_it_is_done(monkeypatch):
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 30.0)
    t = Turns()
    t.serving()
    thread = _waited_in_thread(t)
    assert not thread.done.wait(0.2), "give_way returned while the loop was serving"
    t.served()
    assert thread.done.wait(5.0), "give_way did not return once the loop was back in select"
    thread.join()


def test_an_idle_loop_costs_background_work_no_wait(monkeypatch):
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 30.0)
    t = Turns()
    t.serving()
    t.served()
    assert _waited_in_thread(t).done.wait(5.0), "give_way waited with the loop idle"


def test_a_loop_that_never_ends_serving_delays_each_step_only_so_long(monkeypatch):
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 0.05)
    t = Turns()
    t.serving()
    assert _waited_in_thread(t).done.wait(5.0), "give_way waited past MOST_WAIT_SECONDS"


@contextmanager
def _watched_loop(
    t: Turns,
) -> Iterator[tuple[selectors.EpollSelector, socket.socket, socket.socket]]:
    """An epoll selector `t` watches, on one end of a socket pair: the loop's and a client's."""
    loop = selectors.EpollSelector()
    ours, theirs = socket.socketpair()
    with loop, ours, theirs:
        loop.register(ours, selectors.EVENT_READ)
        t.watch(loop.fileno())
        yield loop, ours, theirs


def test_events_pending_in_the_watched_selector_make_background_work_wait(monkeypatch):
    """A loop woken but not yet holding the GIL cannot mark itself busy: its selector tells."""
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 30.0)
    t = Turns()
    with _watched_loop(t) as (loop, ours, theirs):
        assert _waited_in_thread(t).done.wait(5.0), "give_way waited with no event pending"
        theirs.send(b"GET")
        thread = _waited_in_thread(t)
        assert not thread.done.wait(0.2), "give_way returned with an event pending in the loop"
        assert [key.fileobj for key, _ in loop.select(0)] == [ours], "looking took the event"
        ours.recv(3)
        t.serving()
        t.served()
        assert thread.done.wait(5.0), "give_way did not return once the loop had served"
        thread.join()


def test_events_the_loop_handles_while_it_is_looked_at_leave_no_wait_behind(monkeypatch):
    """The poll releases the GIL: the loop may read and serve the events meanwhile. Nothing the
    looking thread marks then may keep later steps waiting for a loop that is back in select."""
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 30.0)
    t = Turns()
    with _watched_loop(t) as (_, ours, theirs):
        watched = t._events
        assert watched is not None

        class HandledWhileLooking:
            def poll(self, timeout: int) -> list:
                pending = watched.poll(timeout)
                if pending:  # the loop, woken, takes the GIL while the poll is in the kernel
                    t.serving()
                    ours.recv(3)
                    t.served()
                return pending

        monkeypatch.setattr(t, "_events", HandledWhileLooking())
        theirs.send(b"GET")
        for _ in range(3):
            assert _waited_in_thread(t).done.wait(5.0), "a step waited for a loop already idle"


def test_two_deferring_threads_may_look_at_the_loop_at_the_same_time(monkeypatch):
    """The sampler and the anomaly thread both give way. A poll releases the GIL, so the other may
    look meanwhile; one select.poll object polled by two threads at once raises RuntimeError,
    which in the sampler ended the sample (or the thread) and in the anomaly thread a detection."""
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 0.0)
    t = Turns()
    failed: list[BaseException] = []

    def steps() -> None:
        t.defer()
        try:
            for _ in range(20_000):
                t.give_way()
        except Exception as err:  # noqa: BLE001 - the assertion below shows it
            failed.append(err)

    with _watched_loop(t) as (_, _, theirs):
        theirs.send(b"GET")  # pending and never read: each step looks at the selector twice
        threads = [threading.Thread(target=steps) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert not failed, f"give_way failed while another thread gave way: {failed[0]!r}"


def test_a_thread_that_does_not_defer_never_waits(monkeypatch):
    """The loop itself and the HTTP pool's renders go on while the loop serves."""
    monkeypatch.setattr(turns, "MOST_WAIT_SECONDS", 30.0)
    t = Turns()
    t.serving()
    finished = threading.Event()
    thread = threading.Thread(target=lambda: (t.give_way(), finished.set()))
    thread.start()
    assert finished.wait(5.0), "a thread that never deferred waited for the loop"
    thread.join()


def _policy(tid: int = 0) -> int:
    return os.sched_getscheduler(tid)


def _in_thread(work) -> object:
    """What `work()` returns, run in a new thread."""
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(work()))
    thread.start()
    thread.join(60)
    assert found, "the thread did not finish"
    return found[0]


def _spin(cpu_seconds: float) -> None:
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


@contextmanager
def _busy_cpu(cpu: int) -> Iterator[None]:
    """A process of normal policy spinning on `cpu` while the block runs."""
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.3)
        yield
    finally:
        hog.kill()
        hog.wait()


def test_a_deferring_thread_goes_under_sched_idle_after_its_first_round_and_the_others_do_not():
    t = Turns()
    first_round = _in_thread(lambda: (t.defer(), _policy())[1])
    assert first_round == os.SCHED_OTHER, "the first sample, which readiness waits for, was lowered"
    assert _in_thread(lambda: (t.defer(), t.check(), _policy())[2]) == os.SCHED_IDLE
    assert _in_thread(_policy) == os.SCHED_OTHER
    assert _policy() == os.SCHED_OTHER


def test_a_thread_starved_under_sched_idle_brings_every_thread_back_to_the_normal_policy(caplog):
    """Beside a busy process on its CPU, SCHED_IDLE gets a fraction of a percent: the check sees
    the wait and every thread the deferring one started leaves SCHED_IDLE too."""
    t = Turns()
    cpu = min(os.sched_getaffinity(0))
    started = threading.Event()
    child_policy: list[int] = []

    def starved() -> tuple[int, bool]:
        os.sched_setaffinity(0, {cpu})
        t.defer()
        t.check()
        stop = threading.Event()
        child = threading.Thread(
            target=lambda: (started.set(), stop.wait(60), child_policy.append(_policy()))
        )
        child.start()
        started.wait(10)
        _spin(0.003)
        t.check()
        stop.set()
        child.join(10)
        return _policy(), t.lowering

    with _busy_cpu(cpu):
        policy, lowering = _in_thread(starved)
    assert (policy, child_policy, lowering) == (os.SCHED_OTHER, [os.SCHED_OTHER], False)
    assert "leave SCHED_IDLE" in caplog.text
    assert _in_thread(lambda: (t.defer(), t.check(), _policy())[2]) == os.SCHED_OTHER


def test_a_thread_that_shares_its_cpu_evenly_is_not_starved(monkeypatch):
    """Under the normal policy beside a busy process, a thread waits about as long as it runs:
    more than STARVED_SECONDS, far less than STARVED_RATIO times its CPU time."""
    monkeypatch.setattr(turns, "may_return_to_normal", lambda: False)
    t = Turns()
    cpu = min(os.sched_getaffinity(0))

    def shared() -> tuple[int, bool, float]:
        os.sched_setaffinity(0, {cpu})
        t.defer()
        before = turns.cpu_seconds()[1]
        _spin(0.15)
        waited = turns.cpu_seconds()[1] - before
        t.check()
        return _policy(), t.lowering, waited

    with _busy_cpu(cpu):
        policy, lowering, waited = _in_thread(shared)
    assert policy == os.SCHED_OTHER, "lowered although it could not come back"
    assert waited > turns.STARVED_SECONDS, "the busy process did not share the CPU"
    assert lowering, f"starved after waiting {waited:.3f} s for 0.15 s of CPU"


def test_cpu_seconds_are_the_calling_threads_and_leave_no_descriptor_behind():
    """Each thread reads its own schedstat again and again; a thread that ended closed its file."""
    open_files = len(os.listdir("/proc/self/fd"))

    def spun() -> tuple[float, float]:
        before = turns.cpu_seconds()[0]
        _spin(0.05)
        return before, turns.cpu_seconds()[0]

    for _ in range(20):
        before, after = _in_thread(spun)
        assert 0.05 <= after - before < 1.0, (before, after)
    ran_here = turns.cpu_seconds()[0]
    assert turns.cpu_seconds()[0] >= ran_here > 0
    assert len(os.listdir("/proc/self/fd")) <= open_files + 1  # this thread's own, kept


PROBE = """
import os, threading
from kepler_bridge.turns import Turns, restore_normal_policy
found = []
def work():
    turns = Turns()
    turns.defer()
    turns.check()
    found.append(os.sched_getscheduler(0))
    found.append(restore_normal_policy())
    found.append(os.sched_getscheduler(0))
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(*found)
"""


@pytest.mark.parametrize(
    "capabilities, expected",
    [
        ("-all", f"{os.SCHED_OTHER} 0 {os.SCHED_OTHER}"),  # could not come back: never lowered
        ("-all,+sys_nice", f"{os.SCHED_IDLE} 1 {os.SCHED_OTHER}"),
    ],
)
def test_sched_idle_is_taken_only_where_the_thread_can_come_back(capabilities: str, expected: str):
    """With RLIMIT_NICE 0 (the default) and no capability (setpriv) a thread under SCHED_IDLE
    could never return to SCHED_OTHER, so none is lowered; with CAP_SYS_NICE alone it returns."""
    command = [
        "prlimit",
        "--nice=0",
        "setpriv",
        f"--bounding-set={capabilities}",
        "--inh-caps=-all",
    ]
    command += ["--", sys.executable, "-c", PROBE]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected.split()


def test_a_child_started_from_a_thread_under_sched_idle_runs_under_the_normal_policy():
    """The command, npu-smi, the eBPF loader and the model fit start inside `normal_children`."""
    t = Turns()
    policy = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]

    def start_children() -> tuple[str, str, int]:
        t.defer()
        t.check()
        bare = subprocess.run(policy, capture_output=True, text=True, timeout=60).stdout
        with turns.normal_children():
            normal = subprocess.run(policy, capture_output=True, text=True, timeout=60).stdout
        return bare.strip(), normal.strip(), _policy()

    bare, normal, after = _in_thread(start_children)
    assert bare == str(os.SCHED_IDLE), "the kernel did not pass SCHED_IDLE on"
    assert (normal, after) == (str(os.SCHED_OTHER), os.SCHED_IDLE)
