"""Clients that would exhaust the agent's output memory or its descriptors (issue 17): pipelined
answers nobody reads, and more connections than RLIMIT_NOFILE allows. Through the real agent."""

from __future__ import annotations

import contextlib
import http.client
import math
import os
import resource
import socket
import time
from typing import Iterator

import pytest
import requests

from agent import Agent
from hostile_clients import Attack, closed_by_peer, hung_up, send_queue_bytes
from kepler_bridge.http.limits import SEND_BUFFER_BYTES
from kepler_bridge.sources.procfs import read_stat

HEADER_TIMEOUT = 2.0
WRITE_TIMEOUT = 3.0
# How late the agent may notice a timeout (it checks deadlines every 0.25 s) plus scheduling slack.
SLACK = 3.0
PROBES = ("/healthz", "/metrics", "/v1/collect")
NON_READERS = 300
# The bound, 64 MiB queued for 1000 never-reading connections, per connection.
QUEUED_PER_CONNECTION = 64 * 1024
# A generous bound on one probe: behaviour, not milliseconds, on a loaded machine.
PROBE_SECONDS = 5.0
# At most this share of one CPU for the worker while silent connections press on its limit.
CPU_SHARE = 0.3
MIB = 1 << 20
# The kernel's least delayed-ACK time (TCP_DELACK_MIN): a response held at a full send buffer
# waits at least this long for the client's ACK.
DELAYED_ACK_SECONDS = 0.04
SCRAPES = 30

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def enough_descriptors() -> Iterator[None]:
    """This process holds hundreds of client sockets: raise its own RLIMIT_NOFILE (as root)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _agent(header_timeout: float = HEADER_TIMEOUT) -> Agent:
    return Agent(
        "--simulate",
        "2",
        "--sources",
        "simulated",
        "--interval",
        "0.5s",
        "--http-header-timeout",
        f"{header_timeout}s",
        "--http-write-timeout",
        f"{WRITE_TIMEOUT}s",
    )


@contextlib.contextmanager
def _descriptor_limit(soft: int) -> Iterator[None]:
    """Lower this process's soft RLIMIT_NOFILE while a child is started: the child keeps it."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (before, hard))


def _seconds_to_answer(agent: Agent, path: str) -> float:
    started = time.monotonic()
    try:
        ok = requests.get(agent.url + path, timeout=2 * PROBE_SECONDS).status_code == 200
    except requests.RequestException:
        ok = False
    return time.monotonic() - started if ok else math.inf


def _cpu_seconds(pid: int) -> float:
    stat = read_stat("/proc", pid)
    assert stat is not None, f"worker {pid} is gone"
    return stat.cpu_seconds


def _accept_lines(agent: Agent) -> list[str]:
    return [line for line in agent.output().splitlines() if "accept" in line.lower()]


def _probe_while(agent: Agent, seconds: float, paths: tuple[str, ...]) -> dict[str, float]:
    """Fetch `paths` one after another for `seconds`; the slowest answer of each."""
    slowest = dict.fromkeys(paths, 0.0)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in paths:
            slowest[path] = max(slowest[path], _seconds_to_answer(agent, path))
        time.sleep(0.2)
    return slowest


def test_pipelined_answers_nobody_reads_stay_bounded_and_their_connections_close() -> None:
    # Before the fix: every connection autotuned its send buffer towards 4 MiB and got all 200
    # answers (hundreds of MiB queued), and the worker's CPU went to answering them.
    with (
        _agent() as agent,
        Attack(agent.port, non_readers=NON_READERS, pipelined=200, max_seconds=60) as attack,
    ):
        started = time.monotonic()
        peak, slowest = 0, dict.fromkeys(PROBES, 0.0)
        open_ = attack.non_readers
        while open_ and time.monotonic() - started < WRITE_TIMEOUT + 2 * SLACK:
            peak = max(peak, send_queue_bytes(agent.port))
            for path in PROBES:
                slowest[path] = max(slowest[path], _seconds_to_answer(agent, path))
            open_ = [sock for sock in open_ if not hung_up(sock)]
        assert peak < NON_READERS * QUEUED_PER_CONNECTION, f"{peak / MIB:.1f} MiB queued"
        assert not open_, f"{len(open_)} of {NON_READERS} never-reading connections still open"
        assert max(slowest.values()) < PROBE_SECONDS, slowest


def test_more_connections_than_descriptors_are_capped_without_spinning() -> None:
    # Before the fix: accept failed with EMFILE in a loop, at 99 % CPU, one log line each time.
    with _descriptor_limit(512):
        agent = _agent(header_timeout=20).__enter__()
    try:
        with Attack(agent.port, silent=612, max_seconds=30):
            worker = agent.worker_pids()[0]
            cpu, started = _cpu_seconds(worker), time.monotonic()
            slowest = _probe_while(agent, 8, ("/healthz",))
            share = (_cpu_seconds(worker) - cpu) / (time.monotonic() - started)
        assert slowest["/healthz"] < PROBE_SECONDS, slowest
        assert share < CPU_SHARE, f"worker at {share:.0%} of a CPU"
        assert len(_accept_lines(agent)) <= 3, _accept_lines(agent)[:5]
    finally:
        agent.stop()


def test_connections_up_to_the_cap_are_all_kept() -> None:
    """A connection is closed to make room only for a client that waits beyond the cap: as many
    idle connections as the cap allows all stay open, and the next one closes the oldest."""
    with _descriptor_limit(256):
        agent = _agent(header_timeout=20).__enter__()
    socks: list[socket.socket] = []
    try:
        (line,) = [line for line in agent.output().splitlines() if "capped at" in line]
        cap = int(line.split("capped at ")[1].split(":")[0])
        for _ in range(cap):
            socks.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
            time.sleep(0.05)  # each accepted before the next: the count reaches the cap once
        time.sleep(0.5)
        assert [closed_by_peer(sock) for sock in socks] == [False] * cap
        socks.append(socket.create_connection(("127.0.0.1", agent.port), timeout=5))
        agent.wait_for(lambda: closed_by_peer(socks[0]), 5, "the oldest connection closed")
        assert [closed_by_peer(sock) for sock in socks[1:]] == [False] * cap
    finally:
        for sock in socks:
            sock.close()
        agent.stop()


def test_accept_pauses_when_descriptors_run_out_and_logs_once() -> None:
    # Descriptors taken by something other than connections (here: a limit lowered at run time).
    with _agent(header_timeout=20) as agent:
        worker = agent.worker_pids()[0]
        _, hard = resource.prlimit(worker, resource.RLIMIT_NOFILE)
        in_use = len(os.listdir(f"/proc/{worker}/fd"))
        resource.prlimit(worker, resource.RLIMIT_NOFILE, (in_use + 20, hard))
        with Attack(agent.port, silent=100, max_seconds=30):
            cpu, started = _cpu_seconds(worker), time.monotonic()
            time.sleep(8)
            share = (_cpu_seconds(worker) - cpu) / (time.monotonic() - started)
        lines = _accept_lines(agent)
        assert share < CPU_SHARE, f"worker at {share:.0%} of a CPU"
        assert 1 <= len(lines) <= 3, lines[:5]
        assert "RLIMIT_NOFILE" in lines[0], lines[0]
        agent.wait_for(
            lambda: _seconds_to_answer(agent, "/healthz") < PROBE_SECONDS, 10, "/healthz"
        )


def test_a_response_larger_than_the_first_send_buffer_is_not_held_at_delayed_acks() -> None:
    # Before the fix: the fixed 16 KiB send buffer (32 KiB in the kernel) took a larger /metrics in
    # pieces, each waiting for the client's delayed ACK: every scrape on loopback took over 40 ms.
    with Agent("--simulate", "16", "--sources", "simulated", "--interval", "1s") as agent:
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
        took, size = [], 0
        for _ in range(SCRAPES):
            started = time.monotonic()
            conn.request("GET", "/metrics")
            size = len(conn.getresponse().read())
            took.append(time.monotonic() - started)
        conn.close()
    assert size > 3 * SEND_BUFFER_BYTES, size
    held = [seconds for seconds in took if seconds >= DELAYED_ACK_SECONDS]
    assert len(held) < SCRAPES // 2, f"{len(held)} of {SCRAPES} scrapes took over 40 ms: {held}"
