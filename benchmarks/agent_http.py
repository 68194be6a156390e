"""Agent under gunicorn with 8 fake NVML GPUs x 16 processes: latency, throughput, CPU, RSS,
freshness.

Prints one table. Targets (issue 2): /metrics p99 < 5 ms and >= 1500 req/s with 8 clients;
/v1/collect p99 < 3 ms; agent CPU < 0.6 s per minute at a 1 s interval; RSS < 60 MB after
5 minutes; freshness p99 < interval + 200 ms. Needs `wrk` (Debian) for the concurrent runs.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from prometheus_client.utils import floatToGoString  # noqa: E402

from agent import Agent  # noqa: E402
from fakenvml import FakeNvml, build  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def sequential(port: int, path: str, count: int) -> list[float]:
    """Latency in seconds of `count` back-to-back GETs on one keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        timings.append(time.perf_counter() - started)
        assert response.status == 200, response.status
    conn.close()
    return timings


def concurrent(url: str, clients: int, seconds: int) -> float:
    """Requests per second with `clients` keep-alive connections, measured by wrk."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: apt-get install wrk (make bench installs it)")
    out = subprocess.run(
        [wrk, "-t2", f"-c{clients}", f"-d{seconds}s", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    if errors:
        raise SystemExit(f"wrk saw errors: {errors.group(0)}")
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert rate is not None, out
    return float(rate.group(1))


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def memory_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def freshness(agent: Agent, fake: FakeNvml, rounds: int) -> list[float]:
    """Seconds from changing a value in the fake to seeing it on /metrics (polled every 5 ms)."""
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    delays = []
    for round_ in range(rounds):
        value = 1000 + round_  # memory clock in MHz, unique per round
        needle = f"}} {floatToGoString(value * 1e6)}\n".encode()
        fake.gpu(3, clock_memory=value)
        started = time.perf_counter()
        while True:
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            if needle in body:
                break
            time.sleep(0.005)
        delays.append(time.perf_counter() - started)
        time.sleep(0.137 * (round_ % 7))  # change at varied phases of the sampling interval
    conn.close()
    return delays


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--scrapes", type=int, default=2000)
    parser.add_argument("--load-seconds", type=int, default=10)
    parser.add_argument("--cpu-seconds", type=int, default=60, help="idle window for agent CPU")
    parser.add_argument("--rss-minutes", type=float, default=5.0)
    parser.add_argument("--fresh-rounds", type=int, default=60)
    return parser.parse_args()


def http_rows(agent: Agent, fake: FakeNvml, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """Latency and throughput of both endpoints, the /metrics size and the freshness."""
    rows: list[tuple[str, str, str]] = []
    for path, p99_target in (("/metrics", 5.0), ("/v1/collect", 3.0)):
        sequential(agent.port, path, 50)
        timings = sequential(agent.port, path, args.scrapes)
        p50, p99 = percentile(timings, 0.5) * 1e3, percentile(timings, 0.99) * 1e3
        rps = concurrent(agent.url + path, 8, args.load_seconds)
        rows.append(
            (f"{path} latency p50 / p99", f"{p50:.2f} / {p99:.2f} ms", f"p99 < {p99_target} ms")
        )
        rows.append(
            (
                f"{path} throughput, 8 clients",
                f"{rps:.0f} req/s",
                ">= 1500 req/s" if path == "/metrics" else "-",
            )
        )
    size = len(agent.get("/metrics").content)
    rows.append(("/metrics size", f"{size / 1024:.0f} KiB", "-"))
    delays = freshness(agent, fake, args.fresh_rounds)
    rows.append(
        (
            "freshness p50 / p99",
            f"{percentile(delays, 0.5) * 1e3:.0f} / {percentile(delays, 0.99) * 1e3:.0f} ms",
            "p99 < 1200 ms",
        )
    )
    return rows


def cpu_per_minute(agent: Agent, pids: list[int], seconds: int) -> float:
    """Agent CPU seconds a minute over `seconds`, scraped every 15 s (Prometheus' default)."""
    before = cpu_seconds(pids)
    window_end = time.monotonic() + seconds
    while time.monotonic() < window_end:
        agent.get("/metrics")
        time.sleep(min(15.0, max(0.0, window_end - time.monotonic())))
    return (cpu_seconds(pids) - before) * 60 / seconds


def memory_rows(master: int, worker: int, minutes: float) -> list[tuple[str, str, str]]:
    rss_worker, rss_master = memory_kib(worker, "Rss") / 1024, memory_kib(master, "Rss") / 1024
    pss = (memory_kib(worker, "Pss") + memory_kib(master, "Pss")) / 1024
    return [
        (
            f"RSS after {minutes:g} min: worker / master",
            f"{rss_worker:.1f} / {rss_master:.1f} MB",
            "< 60 MB",
        ),
        ("PSS worker + master", f"{pss:.1f} MB", "-"),
    ]


def main() -> None:
    args = arguments()
    work = Path(tempfile.mkdtemp(prefix="kb-bench-"))
    fake = FakeNvml(
        build(work), work / "nvml.conf", gpus=args.gpus, processes_per_gpu=args.processes
    )
    # No call statistics: they cost the fake, not the agent.
    env = {"FAKE_NVML_CONFIG": str(fake.config)}
    with Agent(
        "--sources", "nvml", "--nvml-library", str(fake.library), "--interval", "1s", env=env
    ) as agent:
        assert agent.process is not None  # started by the with
        master = agent.process.pid
        worker = int(Path(f"/proc/{master}/task/{master}/children").read_text().split()[0])
        started = time.monotonic()
        rows = http_rows(agent, fake, args)
        per_minute = cpu_per_minute(agent, [master, worker], args.cpu_seconds)
        rows.append(
            ("agent CPU, 1 s interval, scrape every 15 s", f"{per_minute:.3f} s/min", "< 0.6 s/min")
        )
        time.sleep(max(0.0, args.rss_minutes * 60 - (time.monotonic() - started)))
        rows += memory_rows(master, worker, args.rss_minutes)
        samples = agent.samples("kepler_bridge_sample_duration_seconds")[""]
        rows.append(("sample duration (8 GPUs x 16 processes)", f"{samples * 1e3:.1f} ms", "-"))
    shutil.rmtree(work, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>22}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>22}  {target}")


if __name__ == "__main__":
    main()
