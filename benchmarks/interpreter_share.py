"""What sharing the worker's interpreter costs a scrape (issue 18, point 3), part by part.

The agent runs on the fake NVML (8 GPUs x 16 processes) with a 1 h interval, so its own sampler
is idle and every scrape is answered from cached bytes. A stand-in thread, started in the worker
through a `sitecustomize` module on PYTHONPATH (the agent's code is not changed), defers to the
event loop as the sampler does and, once a second, spends --busy-ms on one kind of work:

  sleep  nothing that holds the GIL (the control);
  spin   pure-Python arithmetic, holding the GIL, a `give_way` checkpoint every 300 iterations;
  walk   the same, but each step looks up 300 entries of a 300,000-entry dict at scattered
         places, so it also touches memory the loop's caches then miss.

Each kind runs --rounds times, alternately, scraping /metrics sequentially on one keep-alive
connection for --seconds; it prints the p50 and p90 of the scrapes that overlap the stand-in's
busy windows and of the others, and their ratio. `scrape_phase.py` gives the same ratio for the
real sampler.

    python benchmarks/interpreter_share.py [--seconds 60] [--rounds 3] [--busy-ms 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import percentile  # noqa: E402
from scrape_phase import agent_on, classify, pcie_fake, scrapes  # noqa: E402

from fakenvml import FakeNvml  # noqa: E402

KINDS = ("sleep", "spin", "walk")
PAUSE = 0.004  # most seconds between two scrapes, as scrape_phase.py's default

# Imported at the worker's start-up (site imports sitecustomize from PYTHONPATH; the master runs
# under -S and the helper children under -I, so they do not). Kind, busy seconds and the log of
# busy windows ("start end", Unix time) come from the environment.
STAND_IN = """
import os
import threading
import time


def _work(kind, busy, log_path):
    from kepler_bridge.turns import TURNS

    table = {n: (n, str(n)) for n in range(300_000)}
    keys = list(table)
    TURNS.defer()
    deadline = time.monotonic() + 1.0
    with open(log_path, "w") as log:
        while True:
            started, end = time.time(), time.perf_counter() + busy
            at = 0
            while time.perf_counter() < end:
                if kind == "sleep":
                    time.sleep(busy)
                elif kind == "spin":
                    total = 0
                    for n in range(300):
                        total += n * n
                else:
                    total = 0
                    for key in keys[at : at + 300]:
                        total += table[key][0]
                    at = (at + 300 * 97) % len(keys)
                TURNS.give_way()
            log.write(f"{started} {time.time()}\\n")
            log.flush()
            TURNS.check()
            deadline += 1.0
            time.sleep(max(0.0, deadline - time.monotonic()))


if os.environ.get("STAND_IN_KIND"):
    threading.Thread(
        target=_work,
        args=(
            os.environ["STAND_IN_KIND"],
            float(os.environ["STAND_IN_BUSY"]),
            os.environ["STAND_IN_LOG"],
        ),
        name="stand-in",
        daemon=True,
    ).start()
"""


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-ms", type=float, default=8.0)
    return parser.parse_args()


def phase(work: Path, fake: FakeNvml, kind: str, args: argparse.Namespace) -> str:
    """One kind's run: its row of the table."""
    log = work / f"windows-{kind}"
    env = {
        "PYTHONPATH": str(work / "site"),
        "STAND_IN_KIND": kind,
        "STAND_IN_BUSY": str(args.busy_ms / 1e3),
        "STAND_IN_LOG": str(log),
    }
    with agent_on(fake, interval="1h", env=env) as agent:
        found = scrapes(agent.port, args.seconds, PAUSE, "/metrics")
    if not log.exists():
        raise SystemExit(
            f"{kind}: the stand-in thread never started (no {log}): the worker did not import "
            f"{work / 'site' / 'sitecustomize.py'}; check that it runs without -S and honours "
            "PYTHONPATH"
        )
    windows = [(float(a), float(b)) for a, b in (line.split() for line in log.open())]
    during, outside, _ = classify(found, windows, 1.0)
    if not during:
        raise SystemExit(f"{kind}: no scrape met a busy window (is the stand-in running?)")

    def ms(latencies: list[float], q: float) -> str:
        return f"{percentile(latencies, q) * 1e3:6.3f}"

    ratio = percentile(during, 0.5) / percentile(outside, 0.5)
    return (
        f"{kind:<6} {len(during):>6} {ms(during, 0.5)} {ms(during, 0.9)}  "
        f"{len(outside):>7} {ms(outside, 0.5)} {ms(outside, 0.9)}  {ratio:5.2f}"
    )


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory(prefix="kb-share-") as directory:
        work = Path(directory)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(STAND_IN)
        fake = pcie_fake(work, 8, 16)
        print(f"stand-in busy {args.busy_ms:g} ms a second; scrape latencies in ms")
        print("kind   during    p50    p90  outside    p50    p90  p50 during / outside")
        for _ in range(args.rounds):
            for kind in KINDS:
                print(phase(work, fake, kind, args), flush=True)


if __name__ == "__main__":
    main()
