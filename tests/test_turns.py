"""The sample gives way to the event loop: `Turns` between threads, and in the real worker."""

from __future__ import annotations

import threading

from kepler_bridge import turns
from kepler_bridge.turns import Turns


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
