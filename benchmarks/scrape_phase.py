"""Scrape latency against the phase of the sampling interval (issue 18, point 3).

Starts the agent (`--sources auto`, fake NVML 8 GPUs x 16 processes, 1 s interval) and scrapes
/metrics sequentially on one keep-alive connection for --seconds, a random pause of up to --pause
between scrapes. Each body says which sample made it: its end (kepler_bridge_last_sample_timestamp_
seconds) and its length (kepler_bridge_sample_duration_seconds). A sample is busy from its start
until the first scrape showing it has been answered (so the state save, the publication and the
first render of the new snapshot count as the sample's). A scrape whose time overlaps a busy window
is "during a sample". Prints the latency percentiles of scrapes during a sample and outside, and a
text histogram of latency by phase: the scrape's start after the last sample's start, in tenths of
the interval; then, within the busy windows, the scrapes answered before the sample's snapshot was
published by their start after the sample's start, in steps of half a millisecond. Target: the p99
during a sample about that outside.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import http.client
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import percentile  # noqa: E402

from agent import Agent  # noqa: E402
from fakenvml import NVML_PCIE_THROUGHPUT_MS, FakeNvml, build  # noqa: E402
from scaffold import wait_for  # noqa: E402

TIMESTAMP = b"\nkepler_bridge_last_sample_timestamp_seconds{"
DURATION = b"\nkepler_bridge_sample_duration_seconds{"
BUCKETS = 10
STEP = 0.0005  # seconds a row of the histogram within the busy windows spans
STEPS = 20  # its rows; the last holds the scrapes that started later still
COLLECT_EVERY = 100  # scrapes between two collections of the client's youngest objects
BAR = 40


@dataclass(frozen=True)
class Scrape:
    """One scrape: when it started and ended (Unix time), and the sample its body came from."""

    started: float
    ended: float
    sample_end: float
    sample_seconds: float

    @property
    def latency(self) -> float:
        return self.ended - self.started


def value(body: bytes, name: bytes) -> float:
    """The value of the first series of metric `name` in a /metrics body."""
    at = body.index(name)
    line_end = body.index(b"\n", at + 1)
    return float(body[at:line_end].rsplit(b" ", 1)[1])


def scrapes(port: int, seconds: float, pause: float, path: str) -> list[Scrape]:
    """Sequential scrapes of `path` for `seconds`, each followed by a pause of up to `pause`. The
    client's own collector runs between scrapes only: a full collection over the scrapes kept took
    up to 5 ms, counted as the agent's latency."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    found: list[Scrape] = []
    end = time.monotonic() + seconds
    gc.disable()
    while time.monotonic() < end:
        if len(found) % COLLECT_EVERY == 0:
            gc.collect(0)
        wall, started = time.time(), time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        latency = time.perf_counter() - started
        assert response.status == 200, response.status
        found.append(Scrape(wall, wall + latency, value(body, TIMESTAMP), value(body, DURATION)))
        time.sleep(random.uniform(0, pause))
    conn.close()
    gc.enable()
    return found


def busy_windows(found: list[Scrape]) -> list[tuple[float, float]]:
    """Each sample's [start, end]: from its start to the end of the first scrape that showed it."""
    first_seen: dict[tuple[float, float], float] = {}
    for scrape in found:
        key = (scrape.sample_end, scrape.sample_seconds)
        first_seen[key] = min(first_seen.get(key, scrape.ended), scrape.ended)
    return sorted((end - seconds, seen) for (end, seconds), seen in first_seen.items())


def classify(
    found: list[Scrape], windows: list[tuple[float, float]], interval: float
) -> tuple[list[float], list[float], list[list[float]]]:
    """Latencies during a sample and outside, and by phase bucket (the scrape's start after the
    start of the last sample that began before it)."""
    starts = [start for start, _ in windows]
    during, outside = [], []
    by_phase: list[list[float]] = [[] for _ in range(BUCKETS)]
    for scrape in found[1:]:  # the first may predate every window seen
        near = bisect.bisect(starts, scrape.ended)  # windows from here on start after it
        overlaps = any(
            start < scrape.ended and scrape.started < end
            for start, end in windows[max(0, near - 2) : near]
        )
        (during if overlaps else outside).append(scrape.latency)
        last = bisect.bisect(starts, scrape.started) - 1
        if last < 0:
            continue
        phase = ((scrape.started - starts[last]) / interval) % 1.0
        by_phase[min(BUCKETS - 1, int(phase * BUCKETS))].append(scrape.latency)
    return during, outside, by_phase


def before_publication(
    found: list[Scrape], windows: list[tuple[float, float]]
) -> list[list[float]]:
    """Latencies of the scrapes that started in a busy window and were answered from an older
    snapshot (one of a sample that ended before this one started), by their start after the
    sample's start (STEP steps, STEPS rows)."""
    starts = [start for start, _ in windows]
    by_offset: list[list[float]] = [[] for _ in range(STEPS)]
    for scrape in found[1:]:
        last = bisect.bisect(starts, scrape.started) - 1
        if last < 0:
            continue
        start, seen = windows[last]
        if scrape.sample_end < start and scrape.started < seen:
            by_offset[min(STEPS - 1, int((scrape.started - start) / STEP))].append(scrape.latency)
    return by_offset


def figures(latencies: list[float]) -> str:
    """Count, p50, p90, p99 and max in ms, in columns."""
    if not latencies:
        return f"{0:>6}"
    p50, p90, p99 = (percentile(latencies, q) * 1e3 for q in (0.5, 0.9, 0.99))
    return f"{len(latencies):>6}  {p50:7.2f}  {p90:7.2f}  {p99:7.2f}  {max(latencies) * 1e3:7.2f}"


def report(found: list[Scrape], interval: float) -> None:
    windows = busy_windows(found)
    during, outside, by_phase = classify(found, windows, interval)
    samples = sorted(seconds for _, seconds in {(s.sample_end, s.sample_seconds) for s in found})
    print(
        f"{len(found)} scrapes, {len(windows)} samples (duration p50 "
        f"{percentile(samples, 0.5) * 1e3:.1f} ms, max {samples[-1] * 1e3:.1f} ms)"
    )
    print(
        f"{'scrapes':<16} {'count':>6}  {'p50 ms':>7}  {'p90 ms':>7}  {'p99 ms':>7}  {'max ms':>7}"
    )
    for name, latencies in (("during a sample", during), ("outside", outside)):
        print(f"{name:<16} {figures(latencies)}")
    print(f"{'all':<16} {figures(during + outside)}")
    if during and outside:
        ratio = percentile(during, 0.99) / percentile(outside, 0.99)
        print(f"p99 during / outside: {ratio:.2f} (target: about 1)")
        ratio = percentile(during, 0.5) / percentile(outside, 0.5)
        print(f"p50 during / outside: {ratio:.2f}")
    spans = [f"{b * 100 // BUCKETS}-{(b + 1) * 100 // BUCKETS}%" for b in range(BUCKETS)]
    print("\nby phase: the scrape's start after the sample's start, in % of the interval; bar: p99")
    histogram(zip(spans, by_phase), 0.99)
    spans = [f"{step * STEP * 1e3:.1f}-{(step + 1) * STEP * 1e3:.1f} ms" for step in range(STEPS)]
    spans[-1] = f"{(STEPS - 1) * STEP * 1e3:.1f}- ms"
    print(
        "\nin the busy windows, answered before the sample's snapshot was published: the scrape's "
        "start after the sample's start; bar: p50"
    )
    histogram(zip(spans, before_publication(found, windows)), 0.5)


def histogram(rows: Iterable[tuple[str, list[float]]], quantile: float) -> None:
    """A row of figures per (label, latencies), with a bar as long as its `quantile`."""
    table = list(rows)
    top = max((percentile(b, quantile) for _, b in table if b), default=1.0) or 1.0
    for span, latencies in table:
        bar = "#" * max(1, round(BAR * percentile(latencies, quantile) / top)) if latencies else ""
        print(f"{span:<16} {figures(latencies)}  {bar}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--pause", type=float, default=0.004, help="most seconds between scrapes")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--sources", default="auto")
    parser.add_argument("--path", default="/metrics")
    return parser.parse_args()


def pcie_fake(work: Path, gpus: int, processes: int) -> FakeNvml:
    """A fake NVML of `gpus` x `processes` in `work`, its PCIe call measuring as NVML's does."""
    fake = FakeNvml(build(work), work / "nvml.conf", gpus=gpus, processes_per_gpu=processes)
    fake.set(pcie_throughput_ms=NVML_PCIE_THROUGHPUT_MS)
    return fake


@contextmanager
def agent_on(
    fake: FakeNvml, sources: str = "auto", interval: str = "1s", env: dict[str, str] | None = None
) -> Iterator[Agent]:
    """The agent on `fake`, its NVML source up and past its first samples and renders; `env`:
    more of the agent's environment."""
    # No call statistics: they cost the fake.
    environment = {"FAKE_NVML_CONFIG": str(fake.config), **(env or {})}
    flags = ("--sources", sources, "--nvml-library", str(fake.library), "--interval", interval)
    with Agent(*flags, env=environment, timeout=120) as agent:
        wait_for(
            lambda: agent.source_states().get("nvml") == "up",
            120,
            "nvml up",
            ignore=(OSError,),
            log=agent.output,
        )
        time.sleep(3.0)
        yield agent


@contextmanager
def fake_nvml_agent(gpus: int, processes: int, sources: str = "auto") -> Iterator[Agent]:
    """The agent at a 1 s interval on a fake NVML of `gpus` x `processes`, its NVML source up and
    past its first samples and renders."""
    fake = pcie_fake(Path(tempfile.mkdtemp(prefix="kb-phase-")), gpus, processes)
    with agent_on(fake, sources) as agent:
        up = sorted(name for name, state in agent.source_states().items() if state == "up")
        print(f"sources up: {', '.join(up)}; {gpus} GPUs x {processes} processes")
        yield agent


def main() -> None:
    args = arguments()
    with fake_nvml_agent(args.gpus, args.processes, args.sources) as agent:
        found = scrapes(agent.port, args.seconds, args.pause, args.path)
    report(found, 1.0)


if __name__ == "__main__":
    main()
