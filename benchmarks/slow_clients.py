"""Probe latency while slowloris and non-reading clients hold connections to the agent (issue 9).

Opens `--silent` connections that send one byte, `--dripping` ones that send a header byte every
`--drip-every` seconds and `--non-readers` that pipeline requests and never read (each reopened
when the agent closes it, so all stay open at once), then, for
`--seconds`, fetches /metrics, /v1/collect and /healthz on a new connection each (as a kubelet
probe does) and prints p50/p99/max per path. Target: p99 < 1 s for 60 s with 200 slow and 20
non-reading clients. Loopback only; everything stops by itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from agent import Agent  # noqa: E402
from hostile_clients import Attack  # noqa: E402

PATHS = ("/metrics", "/v1/collect", "/healthz")
CLIENT_TIMEOUT = 10.0


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--silent", type=int, default=100)
    parser.add_argument("--dripping", type=int, default=100)
    parser.add_argument("--drip-every", type=float, default=2.0)
    parser.add_argument("--non-readers", type=int, default=20)
    return parser.parse_args()


def probe(url: str, seconds: float, timings: dict[str, list[float]]) -> int:
    """Fetch every path on a new connection each until `seconds` pass; how many failed."""
    failures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in PATHS:
            started = time.perf_counter()
            try:
                ok = requests.get(url + path, timeout=CLIENT_TIMEOUT).status_code == 200
            except requests.RequestException:
                ok = False
            timings[path].append(time.perf_counter() - started)
            failures += not ok
    return failures


def print_latencies(timings: dict[str, list[float]]) -> None:
    print(f"{'path':<12} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for path, values in timings.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        median = statistics.median(values)
        print(
            f"{path:<12} {len(values):>8} {median * 1e3:>8.1f} {p99 * 1e3:>8.1f} "
            f"{ordered[-1] * 1e3:>8.1f}"
        )


def main() -> None:
    args = arguments()
    timings: dict[str, list[float]] = {path: [] for path in PATHS}
    with Agent("--simulate", "2", "--sources", "simulated") as agent:
        with Attack(
            agent.port,
            silent=args.silent,
            dripping=args.dripping,
            non_readers=args.non_readers,
            drip_every=args.drip_every,
            max_seconds=args.seconds + 30,
            reconnect=True,
        ) as attack:
            failures = probe(agent.url, args.seconds, timings)
    print(
        f"{args.silent} silent + {args.dripping} dripping (every {args.drip_every:g} s) + "
        f"{args.non_readers} non-reading clients, {args.seconds:g} s, "
        f"client timeout {CLIENT_TIMEOUT:g} s"
    )
    print_latencies(timings)
    print(
        f"failed or timed-out requests: {failures}; "
        f"connections the agent closed and the attack reopened: {attack.reconnects}"
    )


if __name__ == "__main__":
    main()
