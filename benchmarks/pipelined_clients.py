"""Probe latency and queued output while pipelining clients never read their answers (issue 17).

Opens `--connections` connections with a 4 KiB receive buffer that each send `--pipelined`
`GET /metrics` at once and never read (each reopened when the agent closes it, so all stay open at
once), then, for `--seconds`, fetches /metrics, /v1/collect and /healthz on a new connection each
and prints p50/p99/max per path, the peak of the summed kernel send queues of the agent's
connections, the worker's peak RSS and its CPU use. Target: p99 < 1 s and under 64 MiB queued with
1000 connections for 45 s. Loopback only; everything stops by itself.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from slow_clients import CLIENT_TIMEOUT, PATHS, print_latencies, probe  # noqa: E402

from agent import Agent  # noqa: E402
from hostile_clients import Attack, send_queue_bytes  # noqa: E402
from kepler_bridge.sources.procfs import read_stat  # noqa: E402

MIB = 1 << 20
SAMPLE_EVERY = 0.5


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=45)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--pipelined", type=int, default=200)
    return parser.parse_args()


class Peaks:
    """Samples the summed send queues of the agent and its worker's RSS until stopped: the peaks."""

    def __init__(self, port: int, worker: int) -> None:
        self.port, self.worker = port, worker
        self.queued = self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self.queued = max(self.queued, send_queue_bytes(self.port))
            self.rss = max(self.rss, _rss_bytes(self.worker))


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_seconds(pid: int) -> float:
    stat = read_stat("/proc", pid)
    return stat.cpu_seconds if stat else 0.0


def _raise_descriptor_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def main() -> None:
    args = arguments()
    _raise_descriptor_limit(args.connections + 1024)
    timings: dict[str, list[float]] = {path: [] for path in PATHS}
    with Agent("--simulate", "2", "--sources", "simulated") as agent:
        worker = agent.worker_pids()[0]
        cpu_before = _cpu_seconds(worker)
        started = time.monotonic()
        with (
            Attack(
                agent.port,
                non_readers=args.connections,
                pipelined=args.pipelined,
                max_seconds=args.seconds + 30,
                reconnect=True,
            ) as attack,
            Peaks(agent.port, worker) as peaks,
        ):
            failures = probe(agent.url, args.seconds, timings)
            cpu = (_cpu_seconds(worker) - cpu_before) / (time.monotonic() - started)
    print(
        f"{args.connections} never-reading connections, {args.pipelined} pipelined GET /metrics "
        f"each, 4 KiB receive buffer, {args.seconds:g} s, client timeout {CLIENT_TIMEOUT:g} s"
    )
    print_latencies(timings)
    print(
        f"peak summed send queue: {peaks.queued / MIB:.1f} MiB; "
        f"worker peak RSS: {peaks.rss / MIB:.1f} MiB; worker CPU: {cpu * 100:.0f} %"
    )
    print(
        f"failed or timed-out requests: {failures}; "
        f"connections the agent closed and the attack reopened: {attack.reconnects}"
    )


if __name__ == "__main__":
    main()
