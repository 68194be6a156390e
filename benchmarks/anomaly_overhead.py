"""What the anomaly detection costs the running agent: sample duration, scrape latency and the
worker's CPU time, with it on and off, runs alternated.

Each run starts `kepler-bridge serve` with --simulate N accelerators at --interval, scrapes
/metrics once per interval for --seconds, and prints the median sample duration
(kepler_bridge_sample_duration_seconds), the median and 95th percentile of the scrape's wall time,
the worker's CPU time per second (utime + stime of /proc/PID/stat, the fit's child included) and
kepler_bridge_anomaly_cpu_seconds_total per device and sample. The model is fitted on a 2-minute
window (a first fit after 30 s) so that its scoring is in the figures; each fit is a child that
imports scikit-learn (about 2 s of CPU), so --refit 1m shows what refits cost.

    python benchmarks/anomaly_overhead.py [--devices 8] [--seconds 90] [--rounds 2] [--refit 10m]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent import Agent  # noqa: E402
from scaffold import values  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its waited-for children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / TICKS


def run(on: bool, args: argparse.Namespace) -> dict[str, float]:
    flags = ["--sources", "simulated", "--simulate", str(args.devices)]
    flags += ["--interval", str(args.interval), "--anomaly", "true" if on else "false"]
    flags += ["--anomaly-window", "2m", "--anomaly-refit", args.refit]
    with Agent(*flags) as agent:
        worker = agent.worker_pids()[0]
        time.sleep(5)
        start_cpu, started = cpu_seconds(worker), time.monotonic()
        latencies, durations, text = [], [], ""
        while time.monotonic() - started < args.seconds:
            before = time.perf_counter()
            text = requests.get(agent.url + "/metrics", timeout=10).text
            latencies.append(time.perf_counter() - before)
            durations.append(values(text, "kepler_bridge_sample_duration_seconds", "")[""])
            time.sleep(args.interval)
        elapsed = time.monotonic() - started
        used = cpu_seconds(worker) - start_cpu
        anomaly = values(text, "kepler_bridge_anomaly_cpu_seconds_total", "").get("", 0.0)
    latencies.sort()
    return {
        "sample_ms": statistics.median(durations) * 1000,
        "scrape_ms": statistics.median(latencies) * 1000,
        "scrape_p95_ms": latencies[int(0.95 * (len(latencies) - 1))] * 1000,
        "cpu_per_s": used / elapsed,
        "anomaly_cpu": anomaly,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--refit", default="30m", help="--anomaly-refit (the agent's default)")
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (False, True):
            results[on].append(run(on, args))
    print(f"{args.devices} simulated devices, a sample every {args.interval:g} s, "
          f"{args.seconds:g} s per run, {args.rounds} runs each (medians)")  # fmt: skip
    print(f"{'anomaly':<8} {'sample ms':>9} {'scrape ms':>9} {'p95 ms':>7} {'worker CPU %':>12}")
    for on in (False, True):
        rows = results[on]
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(
            f"{'on' if on else 'off':<8} {med['sample_ms']:9.2f} {med['scrape_ms']:9.2f} "
            f"{med['scrape_p95_ms']:7.2f} {med['cpu_per_s'] * 100:12.2f}"
        )
    anomaly = statistics.median(r["anomaly_cpu"] for r in results[True])
    per = anomaly / ((args.seconds + 5) / args.interval) / args.devices * 1e6
    print(f"kepler_bridge_anomaly_cpu_seconds_total at the end: {anomaly:.2f} s, about "
          f"{per:.0f} us per device and sample (fits included)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
