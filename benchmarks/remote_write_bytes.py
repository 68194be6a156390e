"""Bytes on the wire per node for remote write (issue 19, point 1).

The agent with 8 simulated GPUs, its default metric set and the seed's allow-list
(tests/fixtures/seed-metrics-allow-list.json), each scraped at 15 s and at 60 s by the shipped
Prometheus agent (manifests/kubeedge/remote-write/: snappy-compressed protobuf, metadata every
minute, over HTTPS with basic auth) writing to Debian's VictoriaMetrics through a loopback proxy
that counts the bytes. Each configuration is measured over a whole number of its intervals, from
mid-way between two sends; Prometheus' own prometheus_remote_storage_bytes_total (payload only,
no HTTP or TLS) is the cross-check. Prints bytes/s per node and the WAL's growth per hour.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent import Agent  # noqa: E402
from remote_write_rig import (  # noqa: E402
    PASSWORD,
    USER,
    PrometheusAgent,
    TcpProxy,
    Tls,
    VictoriaMetrics,
    render_config,
)

SEED_ALLOW_LIST = ROOT / "tests" / "fixtures" / "seed-metrics-allow-list.json"
GOAL = 2000.0
SEED_LINK = 50_000.0
PAYLOAD = (
    "prometheus_remote_storage_bytes_total",
    "prometheus_remote_storage_metadata_bytes_total",
)
SAMPLES = "prometheus_remote_storage_samples_total"


@dataclass
class Run:
    """One metric set at one interval: its proxy, its Prometheus agent, its measuring window."""

    metrics: str
    interval: int
    proxy: TcpProxy
    writer: PrometheusAgent
    start: float = 0.0
    end: float = 0.0
    at_start: dict[str, float] = field(default_factory=dict)
    at_end: dict[str, float] = field(default_factory=dict)

    def counters(self) -> dict[str, float]:
        payload = sum(self.writer.metric(name) for name in PAYLOAD)
        return {
            "wire": self.proxy.sent,
            "down": self.proxy.received,
            "payload": payload,
            "samples": self.writer.metric(SAMPLES),
            "wal": self.writer.wal_bytes(),
            "cpu": self.writer.cpu_seconds(),
            "rss": self.writer.rss_bytes(),
            "time": time.time(),
        }

    def rate(self, key: str) -> float:
        seconds = self.at_end["time"] - self.at_start["time"]
        return (self.at_end[key] - self.at_start[key]) / seconds


def _start(stack: ExitStack, work: Path) -> list[Run]:
    """The receiver, the two agents and the four Prometheus agents, each behind its proxy."""
    tls = Tls(work / "pki")
    (work / "vm").mkdir()
    receiver = VictoriaMetrics(work / "vm", tls)
    stack.callback(receiver.stop)
    secret = {"username": USER, "password": PASSWORD, "ca.crt": tls.ca.read_text()}
    runs = []
    for metrics, extra in (
        ("default", ()),
        ("seed allow-list", ("--config", str(SEED_ALLOW_LIST))),
    ):
        agent = stack.enter_context(Agent("--simulate", "8", *extra))
        for interval in (15, 60):
            proxy = TcpProxy(receiver.port)
            stack.callback(proxy.close)
            edge = work / f"{metrics.replace(' ', '-')}-{interval}"
            edge.mkdir()
            url = f"https://127.0.0.1:{proxy.port}/api/v1/write"
            config = render_config(edge, f"127.0.0.1:{agent.port}", f"{interval}s", [url], secret)
            writer = PrometheusAgent(edge, config)
            stack.callback(writer.stop)
            runs.append(Run(metrics, interval, proxy, writer))
    return runs


def _measure(runs: list[Run], minutes: float) -> None:
    """Open each run's window half an interval after its first send; close it whole intervals
    later."""
    deadline = time.monotonic() + minutes * 60 + 180
    while any(not run.at_end for run in runs):
        if time.monotonic() > deadline:
            raise SystemExit("remote_write_bytes: a Prometheus agent never sent: see its log")
        now = time.time()
        for run in runs:
            run.writer.check_alive()
            if not run.start and run.proxy.sent:
                run.start = now + run.interval / 2
                run.end = run.start + max(1, round(minutes * 60 / run.interval)) * run.interval
            elif run.start and not run.at_start and now >= run.start:
                run.at_start = run.counters()
            elif run.at_start and not run.at_end and now >= run.end:
                run.at_end = run.counters()
        time.sleep(0.2)


def _report(runs: list[Run]) -> None:
    print(
        f"{'metric set':<16} {'interval':>8} {'samples/s':>9} {'wire B/s':>9} {'payload B/s':>11} "
        f"{'acks B/s':>8} {'of 50 KB/s':>10} {'of 2 KB/s':>9} {'WAL MB/h':>8} {'CPU s/min':>9} "
        f"{'RSS MB':>6}"
    )
    for run in runs:
        wire = run.rate("wire")
        print(
            f"{run.metrics:<16} {run.interval:>7}s {run.rate('samples'):>9.1f} {wire:>9.0f} "
            f"{run.rate('payload'):>11.0f} {run.rate('down'):>8.0f} {wire / SEED_LINK:>10.1%} "
            f"{wire / GOAL:>9.0%} {run.rate('wal') * 3600 / 1e6:>8.2f} "
            f"{run.rate('cpu') * 60:>9.2f} {run.at_end['rss'] / 1e6:>6.1f}"
        )
    print(
        "wire: what the proxy carried to the receiver (HTTP over TLS, without TCP/IP headers); "
        "payload: Prometheus' own count of snappy-compressed samples and metadata; "
        "CPU and RSS: the Prometheus agent's"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="measuring window of each run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        runs = _start(stack, Path(tmp))
        _measure(runs, args.minutes)
        _report(runs)


if __name__ == "__main__":
    main()
