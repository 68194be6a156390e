"""What a sampler in a process of its own would buy the scrapes (issue 18, point 3), before anyone
builds one.

Alternately, --rounds times: (in) the agent as `scrape_phase.py` runs it, sampling at 1 s, its
busy windows found from the scrape bodies; (apart) the agent with a 1 h interval, so it only
answers from its cached bytes, beside a stand-in: another process that does a sample's work each
second on the same fake NVML (read, state save, publication, the /metrics render and the anomaly
detectors, under SCHED_IDLE as the agent's sampler runs), its busy windows logged by wall clock.
Both phases scrape /metrics sequentially on one keep-alive connection for --seconds; prints, per
phase, the latency of scrapes during a busy window and outside it, and their ratios.

--memory prices the other side: PSS and RSS of a worker-like process (the stand-in's work and the
app's imports, no HTTP) with the work in a thread, as now; in a child forked from it once the work
ran 10 s (apart); and in a child forked before the sampler is made, its modules imported (early).

    python benchmarks/sampler_apart.py [--seconds 60] [--rounds 3] [--memory]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import percentile  # noqa: E402
from peers import tree_memory_mb  # noqa: E402
from scrape_phase import agent_on, busy_windows, classify, pcie_fake, scrapes  # noqa: E402

from fakenvml import FakeNvml  # noqa: E402
from scaffold import make_config  # noqa: E402

PAUSE = 0.004  # most seconds between two scrapes, as scrape_phase.py's default
SETTLE = 6.0  # seconds the stand-in runs before the scrapes start


class StandIn:
    """A sample's work, as the agent's sampler thread and anomaly thread do it: read, state save,
    publication, the /metrics render and the detectors."""

    def __init__(self, library: str) -> None:
        from kepler_bridge.anomaly.monitor import AnomalyMonitor, AnomalySettings
        from kepler_bridge.http.server import settle_collector
        from kepler_bridge.sampling.sampler import Sampler
        from kepler_bridge.store import SnapshotStore

        config = make_config(
            sources="nvml,ebpf", nvml_library=library, kube_source="off", pod_resources_socket=""
        )
        self.store = SnapshotStore()
        self.state = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.sampler = Sampler(config, self.store, state_dir=self.state)
        self.monitor = AnomalyMonitor(self.store, lambda: AnomalySettings.of(config))
        settle_collector()

    def work(self) -> None:
        from kepler_bridge.exposition import prometheus

        snapshot = self.sampler.sample()
        self.sampler._save()
        self.store.publish(snapshot)
        prometheus.render(snapshot, lambda name: True)
        self.store.anomalies = self.monitor.take(snapshot)

    def run(self, seconds: float, log: Path | None = None) -> None:
        """`work` once a second for `seconds`, each busy window appended to `log` as "start end"
        (Unix time)."""
        deadline = time.monotonic()
        end = deadline + seconds
        with log.open("w") if log is not None else open(os.devnull, "w") as windows:
            while time.monotonic() < end:
                started = time.time()
                self.work()
                windows.write(f"{started} {time.time()}\n")
                windows.flush()
                deadline += 1.0
                time.sleep(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.sampler.stop()
        shutil.rmtree(self.state, ignore_errors=True)


def stand_in(library: str, log: Path, seconds: float) -> None:
    """The stand-in sampler process: under SCHED_IDLE, as the agent's sampler runs."""
    sampling = StandIn(library)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    sampling.run(seconds, log)
    sampling.close()


def memory_probe(mode: str, library: str) -> None:
    """A worker without HTTP: the sampler's work and the app's imports, PSS and RSS of the process
    and its child printed 45 s after the start. `in`: the work runs 10 s, then 40 s more in a thread
    (as now); `apart`: those 40 s in a child forked then, the parent idle; `early`: the work in a
    child forked before the sampler is made (its modules imported first, so shared), the parent
    idle."""
    from kepler_bridge.anomaly import monitor  # noqa: F401 (the stand-in's imports, shared)
    from kepler_bridge.exposition import prometheus  # noqa: F401
    from kepler_bridge.http import app  # noqa: F401 (the serving side's imports)
    from kepler_bridge.http.server import settle_collector, tune_malloc
    from kepler_bridge.sampling import sampler  # noqa: F401

    tune_malloc()
    child = None
    if mode == "early":
        settle_collector()
        child = os.fork()
        if child == 0:
            sampling = StandIn(library)
            sampling.run(50)
            sampling.close()
            os._exit(0)
    else:
        sampling = StandIn(library)
        sampling.run(10)
        if mode == "apart":
            child = os.fork()
            if child == 0:
                sampling.run(40)
                os._exit(0)  # the parent closes
        else:
            thread = threading.Thread(target=sampling.run, args=(40,))
            thread.start()
    time.sleep(45 if mode == "early" else 35)
    pss, rss = tree_memory_mb(os.getpid())
    print(f"{mode:<8} {pss:7.1f}  {rss:7.1f}", flush=True)
    if child is not None:
        os.waitpid(child, 0)
    else:
        thread.join()
    if mode != "early":
        sampling.close()


def memory(fake: FakeNvml, rounds: int) -> None:
    """`memory_probe` in a process of its own, in and apart alternately."""
    print("sampler  PSS MB   RSS MB  (a worker without HTTP, 8 fake GPUs x 16 processes)")
    env = {**os.environ, "FAKE_NVML_CONFIG": str(fake.config)}
    for _ in range(rounds):
        for mode in ("in", "apart", "early"):
            probe = [sys.executable, __file__, "--memory-probe", mode, str(fake.library)]
            subprocess.run(probe, env=env, check=True, timeout=120)


def phase(fake: FakeNvml, apart: bool, seconds: float, log: Path) -> tuple[list, list, float]:
    """Latencies during a busy window and outside, and the windows' median ms, of one phase."""
    with agent_on(fake, interval="1h" if apart else "1s") as agent:
        if not apart:
            found = scrapes(agent.port, seconds, PAUSE, "/metrics")
            windows = busy_windows(found)
        else:
            child = subprocess.Popen(
                [sys.executable, __file__, "--stand-in", str(fake.library), str(log)],
                env={
                    **os.environ,
                    "FAKE_NVML_CONFIG": str(fake.config),
                    "STAND_IN_SECONDS": str(seconds + SETTLE + 2),
                },
            )
            time.sleep(SETTLE)
            found = scrapes(agent.port, seconds, PAUSE, "/metrics")
            if child.wait(timeout=30) != 0:
                raise SystemExit("the stand-in sampler failed")
            lines = log.read_text().splitlines()
            windows = [(float(a), float(b)) for a, b in (line.split() for line in lines)]
    during, outside, _ = classify(found, windows, 1.0)
    lengths = sorted(end - start for start, end in windows)
    return during, outside, lengths[len(lengths) // 2] * 1e3


def row(name: str, during: list[float], outside: list[float], window_ms: float) -> str:
    def ms(latencies: list[float], q: float) -> str:
        return f"{percentile(latencies, q) * 1e3:5.2f}"

    ratios = (percentile(during, q) / percentile(outside, q) for q in (0.5, 0.99))
    return (
        f"{name:<8} {window_ms:7.1f}  {len(during):>5} {ms(during, 0.5)} {ms(during, 0.99)}  "
        f"{len(outside):>6} {ms(outside, 0.5)} {ms(outside, 0.99)}  "
        + "  ".join(f"{ratio:5.2f}" for ratio in ratios)
    )


def main() -> None:
    if sys.argv[1:2] == ["--stand-in"]:
        stand_in(sys.argv[2], Path(sys.argv[3]), float(os.environ["STAND_IN_SECONDS"]))
        return
    if sys.argv[1:2] == ["--memory-probe"]:
        memory_probe(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="PSS in, apart and early: no scrapes")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kb-apart-"))
    fake = pcie_fake(work, 8, 16)
    if args.memory:
        try:
            memory(fake, args.rounds)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    print("8 fake GPUs x 16 processes, 1 s samples; latencies in ms; ratios during / outside")
    print("sampler  window  during  p50   p99  outside  p50   p99    p50x   p99x")
    try:
        for round_ in range(args.rounds):
            for apart in (False, True):
                found = phase(fake, apart, args.seconds, work / f"windows-{round_}")
                print(row("apart" if apart else "in", *found), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
