"""A fleet of agents scraped by one real Prometheus that remote-writes to a loopback sink (#19).

Starts --agents agents (`kepler-bridge serve --simulate --gpus`, each its own node name, loopback
port and simulate seed, sampling every --interval with the procfs source, no Kubernetes), one
Debian Prometheus that scrapes them all every --interval with the gpu-alerts and gpu-fleet rules
loaded and remote-writes every scraped series (the recorded ones dropped, as a cloud would get
them from edge agents) to a counting HTTP sink in this script. Once every target has been
scraped it measures for --minutes: the agents' CPU (utime + stime of master and worker, reaped
children included) and memory (PSS from /proc/PID/smaps_rollup summed over all their
processes), Prometheus' head series, samples appended a second, the p50/p99 of every
scrape_duration_seconds of the window, the bytes a second the sink received beside
prometheus_remote_storage_bytes_total, and Prometheus' own CPU and memory; prints them for the
fleet and per node. Every process it starts ends with it (TERM, then KILL after 20 s), also on an
error, Ctrl-C or SIGTERM. Needs Debian's prometheus (`make deps`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import percentile  # noqa: E402
from peers import tree_cpu_seconds, tree_memory_mb  # noqa: E402

from agent import Agent  # noqa: E402
from promserver import Daemon, http_get  # noqa: E402
from scaffold import by_name, free_port, wait_for  # noqa: E402

RULES = (ROOT / "alerts" / "gpu-alerts.rules.yml", ROOT / "alerts" / "gpu-fleet.rules.yml")
JOB = "kepler-bridge-fleet"
STOP_SECONDS = 20.0  # all agents together, after TERM, before KILL
QUERY_SECONDS = 120.0  # Prometheus' own query timeout is 2 minutes


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8, help="simulated accelerators per agent")
    parser.add_argument("--interval", type=int, default=15, help="seconds: sampling and scrape")
    parser.add_argument("--minutes", type=float, default=5, help="measured window")
    parser.add_argument("--sources", default="procfs", help="kepler-bridge --sources")
    parser.add_argument("--starting", type=int, default=4, help="agents started at once")
    parser.add_argument("--node-prefix", default="edge", help="node names: PREFIX-000, ...")
    args = parser.parse_args()
    if not 1 <= args.agents <= 200 or not 1 <= args.gpus <= 64:
        parser.error("--agents: 1 to 200; --gpus: 1 to 64")
    if not 1 <= args.interval <= 300 or not 0 < args.minutes <= 60:
        parser.error("--interval: 1 to 300 s; --minutes: more than 0, at most 60")
    return args


class Sink:
    """A remote-write receiver on loopback that counts requests and body bytes, answering 204."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real receiver

            def do_POST(self) -> None:  # noqa: N802
                size = len(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with sink.lock:
                    sink.requests, sink.bytes = sink.requests + 1, sink.bytes + size
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return self.requests, self.bytes

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_args(n: int, args: argparse.Namespace) -> list[str]:
    return [
        *("--node-name", f"{args.node_prefix}-{n:03d}", "--simulate", str(args.gpus)),
        *("--simulate-seed", str(n), "--sources", args.sources),
        *("--interval", f"{args.interval}s", "--kube-source", "off"),
    ]


def stop_agents(agents: list[Agent]) -> None:
    """TERM every agent, then KILL those still running after STOP_SECONDS for all of them."""
    running = [agent.process for agent in agents if agent.process and agent.process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for process in running:
        with contextlib.suppress(Exception):
            process.wait(max(0.1, deadline - time.monotonic()))
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def fleet(args: argparse.Namespace) -> Iterator[list[Agent]]:
    """The agents, ready, started --starting at a time; all stopped at the end."""
    agents: list[Agent] = []
    while len(agents) < args.agents:
        agent = Agent(*agent_args(len(agents), args), timeout=300)
        if agent.port not in {other.port for other in agents}:  # free_port can repeat itself
            agents.append(agent)
    try:
        with ThreadPoolExecutor(args.starting) as pool:
            list(pool.map(Agent.__enter__, agents))
        yield agents
    finally:
        stop_agents(agents)


def prometheus_config(agents: list[Agent], sink: Sink, interval: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{interval}s", "evaluation_interval": f"{interval}s"},
        "rule_files": [str(path) for path in RULES],
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{a.port}" for a in agents]}],
            }
        ],
        "remote_write": [
            {
                "url": sink.url,
                "write_relabel_configs": [
                    {"source_labels": ["__name__"], "regex": ".+:.+", "action": "drop"}
                ],
            }
        ],
    }


class Prometheus(Daemon):
    """Debian's Prometheus on loopback with the fleet's configuration."""

    def __init__(self, work: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus is missing: run bash scripts/apt-install.sh prometheus")
        super().__init__(
            [
                binary,
                "--config.file=prometheus.yml",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            work,
            "prometheus",
        )
        wait_for(lambda: http_get(f"{self.url}/-/ready"), 60, "Prometheus ready", ignore=(OSError,))

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result of an instant query; asked again once where the loaded host timed it out."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            body = http_get(url, timeout=QUERY_SECONDS)
        except TimeoutError:
            body = http_get(url, timeout=QUERY_SECONDS)
        return json.loads(body)["data"]["result"]

    def own(self, name: str) -> float:
        """The sum of one of its own metrics, from its /metrics (it does not scrape itself)."""
        text = http_get(f"{self.url}/metrics", timeout=QUERY_SECONDS).decode()
        return sum(value for _, value in by_name(text).get(name, []))


@dataclass
class Reading:
    """Counters at one moment of the window."""

    at: float
    agents_cpu: float
    prometheus_cpu: float
    appended: float
    remote_bytes: float
    sink_requests: int
    sink_bytes: int
    host_processes: int  # procfs reads each of them every sample: the agents' CPU follows it


def read(agents: list[Agent], prometheus: Prometheus, sink: Sink) -> Reading:
    requests, body = sink.counts()
    return Reading(
        at=time.monotonic(),
        agents_cpu=sum(tree_cpu_seconds(agent.process.pid) for agent in agents if agent.process),
        prometheus_cpu=tree_cpu_seconds(prometheus.process.pid),
        appended=prometheus.own("prometheus_tsdb_head_samples_appended_total"),
        remote_bytes=prometheus.own("prometheus_remote_storage_bytes_total"),
        sink_requests=requests,
        sink_bytes=body,
        host_processes=sum(1 for name in os.listdir("/proc") if name.isdigit()),
    )


def scrape_durations(prometheus: Prometheus, seconds: float) -> list[float]:
    """Every scrape_duration_seconds of the fleet's targets in the last `seconds`."""
    series = prometheus.query(f'scrape_duration_seconds{{job="{JOB}"}}[{int(seconds)}s]')
    return [float(value) for one in series for _, value in one["values"]]


Row = tuple[str, float, float | None, str]


def measure(
    agents: list[Agent], prometheus: Prometheus, sink: Sink, args: argparse.Namespace
) -> list[Row]:
    """The table's rows, measured over --minutes from the first scrape of every agent."""
    wait_for(
        lambda: len(prometheus.query(f'up{{job="{JOB}"}} == 1')) == len(agents),
        120 + 2 * args.interval,
        "every agent scraped",
        step=1,
        ignore=(OSError,),
    )
    before = read(agents, prometheus, sink)
    time.sleep(args.minutes * 60)
    after = read(agents, prometheus, sink)
    return agent_rows(before, after, agents) + prometheus_rows(before, after, prometheus, args)


def agent_rows(before: Reading, after: Reading, agents: list[Agent]) -> list[Row]:
    n, seconds = len(agents), after.at - before.at
    cpu = (after.agents_cpu - before.agents_cpu) * 60 / seconds
    pss = sum(tree_memory_mb(agent.process.pid)[0] for agent in agents if agent.process)
    return [
        ("agents' CPU", cpu, cpu / n, "s/min"),
        ("agents' memory (PSS, all their processes)", pss, pss / n, "MB"),
        ("processes on the host (start; end)", before.host_processes, after.host_processes, ""),
    ]


def prometheus_rows(
    before: Reading, after: Reading, prometheus: Prometheus, args: argparse.Namespace
) -> list[Row]:
    n, seconds = args.agents, after.at - before.at
    durations = scrape_durations(prometheus, seconds)
    per_target = [
        float(one["value"][1]) for one in prometheus.query(f'scrape_samples_scraped{{job="{JOB}"}}')
    ]
    scraped_rate = sum(per_target) / args.interval
    head = prometheus.own("prometheus_tsdb_head_series")
    appended = (after.appended - before.appended) / seconds
    sink_rate = (after.sink_bytes - before.sink_bytes) / seconds
    remote_rate = (after.remote_bytes - before.remote_bytes) / seconds
    requests = (after.sink_requests - before.sink_requests) / seconds
    cpu = (after.prometheus_cpu - before.prometheus_cpu) * 60 / seconds
    return [
        ("samples a scrape (fewest; median)", min(per_target), percentile(per_target, 0.5), ""),
        ("Prometheus head series (scraped + recorded)", head, head / n, "series"),
        ("samples scraped (each target's last / interval)", scraped_rate, scraped_rate / n, "/s"),
        ("samples appended (scrapes and rules)", appended, appended / n, "/s"),
        ("scrape duration p50", percentile(durations, 0.5) * 1e3, None, "ms"),
        ("scrape duration p99", percentile(durations, 0.99) * 1e3, None, "ms"),
        ("remote write: bytes the sink received", sink_rate, sink_rate / n, "bytes/s"),
        ("remote write: prometheus_remote_storage_bytes", remote_rate, remote_rate / n, "bytes/s"),
        ("remote write: requests", requests, requests / n, "/s"),
        ("Prometheus CPU", cpu, cpu / n, "s/min"),
        ("Prometheus memory (PSS)", tree_memory_mb(prometheus.process.pid)[0], None, "MB"),
        (
            "Prometheus Go heap in use",
            prometheus.own("go_memstats_heap_inuse_bytes") / 1e6,
            None,
            "MB",
        ),
        (f"scrapes in the window ({seconds:.0f} s)", len(durations), len(durations) / n, ""),
    ]


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        f"| {'quantity':48} | {'fleet':>12} | {'per node':>12} | unit    |",
        f"|{'-' * 50}|{'-' * 13}:|{'-' * 13}:|---------|",
    ]
    for name, fleet_value, node, unit in rows:
        per = f"{node:12.3f}" if node is not None else f"{'':12}"
        lines.append(f"| {name:48} | {fleet_value:12.3f} | {per} | {unit:7} |")
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind as Ctrl-C does
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{args.agents} agents x {args.gpus} simulated accelerators, {args.interval} s interval, "
        f"sources {args.sources}, {args.minutes:g} min window; started {started}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="fleet-") as scratch, contextlib.ExitStack() as stack:
        sink = Sink()
        stack.callback(sink.stop)
        agents = stack.enter_context(fleet(args))
        print(f"  {len(agents)} agents ready", flush=True)
        prometheus = Prometheus(Path(scratch), prometheus_config(agents, sink, args.interval))
        stack.callback(prometheus.stop)
        rows = measure(agents, prometheus, sink, args)
    print(table(rows))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"host: {os_release()}, {os.cpu_count()} CPUs, load average at the end {load}")


def os_release() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return "unknown system"


if __name__ == "__main__":
    main()
