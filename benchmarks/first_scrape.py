"""Latency of a scrape that finds its snapshot not rendered yet, as Prometheus's scrapes mostly do.

Starts the agent (`--sources auto`, fake NVML --gpus x --processes, 1 s interval) and scrapes
/metrics --scrapes times with Prometheus's own Accept (OpenMetrics first) and Accept-Encoding
(gzip) headers, a new connection each, one every --every seconds: slower than two samples, so the
render cache never counts the variant steady and each scrape waits for its render (families,
writing, gzip) on the pool. Prints the median, p90 and max in ms. Compare a change with main on
the same machine, the two alternately.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import percentile  # noqa: E402
from scrape_phase import fake_nvml_agent  # noqa: E402

# What Prometheus 2.x sends (scrape/scrape.go, acceptHeader with OpenMetrics 1.0 first).
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}


def scrape(port: int) -> float:
    """Seconds of one scrape on a new connection; its answer must be gzipped OpenMetrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    started = time.perf_counter()
    conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
    response = conn.getresponse()
    response.read()
    seconds = time.perf_counter() - started
    conn.close()
    assert response.status == 200, response.status
    assert response.getheader("Content-Encoding") == "gzip"
    assert "openmetrics" in response.getheader("Content-Type", "")
    return seconds


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--every", type=float, default=2.3, help="seconds between scrapes")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    with fake_nvml_agent(args.gpus, args.processes) as agent:
        latencies = []
        for _ in range(args.scrapes):
            latencies.append(scrape(agent.port))
            time.sleep(args.every)
    median, p90 = statistics.median(latencies), percentile(latencies, 0.9)
    print(
        f"{args.gpus} GPUs x {args.processes} processes, a Prometheus scrape (OpenMetrics, gzip) "
        f"every {args.every} s that finds its snapshot not rendered yet: median "
        f"{median * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms, max {max(latencies) * 1e3:.2f} ms "
        f"({args.scrapes} scrapes)"
    )


if __name__ == "__main__":
    main()
