"""How the agent's cost grows with the host (issue 18): sample cost and CPU against processes, GPUs.

For each accelerator count (--gpus: fake NVML GPUs with --gpu-processes real sleeping processes
each) the real agent runs with --sources auto (eBPF + NVML as root, else procfs) at a 1 s
interval; for each host size (--sizes: sleeping processes added, in ascending order, so that no
process ends while the agent measures and none waits in its --process-grace) it settles, then
reads kepler_bridge_sample_duration_seconds from /metrics once a second for --window s (median
and p90 of the distinct samples) and the agent's CPU over the window (utime + stime of master and
worker, the scrapes once a second included), beside the tasks runnable on the (shared) host and
the processes started there a second (a window is measured again, --retries times at most, while
another job starts more than 20 a second).
Prints a table, then the least-squares lines of both against the processes on the host and the
GPUs, with the residuals of every point. --max-processes 0 lifts the agent's cap on tracked
processes (above it, the excess is evicted and read anew every sample). Every process it starts
ends with it, also on an error or Ctrl-C. Needs a C compiler; root for eBPF.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from agent_http import percentile  # noqa: E402
from peers import Exporter, agent, gpu_processes, tree_cpu_seconds, tree_memory_mb  # noqa: E402
from scaling_fit import Point, report  # noqa: E402
from sleepers import SLEEPERS_C, build, sleepers  # noqa: E402

from kepler_bridge import config  # noqa: E402
from scaffold import values  # noqa: E402

DURATION = "kepler_bridge_sample_duration_seconds"
LAST_SAMPLE = "kepler_bridge_last_sample_timestamp_seconds"
SLEEPER_MB = 0.2  # memory per sleeping process: about 0.1 MB measured, twice for headroom
START_SECONDS = 15  # an agent start with eBPF on a busy 2-core machine, about
SPAWN_PER_SECOND = 3000  # sleeping processes forked a second, about
# Processes started a second on the host above which a window is measured again: each new process
# costs the agent a read of its cgroup, and ended ones stay in its table for --process-grace.
CHURN_LIMIT = 20


def arguments() -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 3000, 10000])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--gpu-processes", type=int, default=4, help="sleeping processes a GPU")
    parser.add_argument("--window", type=float, default=30, help="seconds measured per point")
    parser.add_argument("--settle", type=float, default=5, help="seconds before each window")
    parser.add_argument("--agent-sources", default="auto", help="kepler-bridge --sources")
    parser.add_argument(
        "--max-processes", type=int, help="kepler-bridge --max-processes (0: no cap)"
    )
    parser.add_argument(
        "--retries", type=int, default=2, help=f"windows again over {CHURN_LIMIT} new processes/s"
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.gpus, args.window, args.settle = [100, 1000], [1, 8], 8, 2
    args.sizes = sorted(set(args.sizes))
    if not 0 <= min(args.sizes) <= max(args.sizes) <= 20000:
        parser.error("--sizes: 0 to 20000 sleeping processes")
    if not 1 <= min(args.gpus) <= max(args.gpus) <= 64 or not 1 <= args.gpu_processes <= 64:
        parser.error("--gpus: 1 to 64; --gpu-processes: 1 to 64")
    if not 0 <= args.retries <= 5:
        parser.error("--retries: 0 to 5")
    return args


def expected_seconds(args: Namespace, retries: int = 0) -> float:
    """About how long the whole run takes, each window measured `retries` more times."""
    per_size = args.settle + (args.window + 1) * (1 + retries)  # + the last read's wait
    spawn = max(args.sizes) / SPAWN_PER_SECOND
    return len(args.gpus) * (START_SECONDS + spawn + len(args.sizes) * per_size)


def check_room(args: Namespace) -> None:
    """Refuse to start where the pids or the memory for the sleeping processes are missing."""
    needed = max(args.sizes) + max(args.gpus) * args.gpu_processes
    tasks = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if tasks + needed + 1000 > pid_max:
        raise SystemExit(
            f"{needed} more processes beside {tasks} tasks would come near kernel.pid_max "
            f"{pid_max}: raise it (sysctl -w kernel.pid_max=4194304) or pass smaller --sizes"
        )
    available = meminfo_mb("MemAvailable")
    if needed * SLEEPER_MB + 1024 > available:
        raise SystemExit(
            f"{needed} sleeping processes need about {needed * SLEEPER_MB:.0f} MB and 1 GB spare; "
            f"{available:.0f} MB available: pass smaller --sizes"
        )


def meminfo_mb(field: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e6
    raise KeyError(field)


def host_pids() -> set[str]:
    """The processes on the host now (the agent's pid namespace)."""
    return {name for name in os.listdir("/proc") if name.isdigit()}


def runnable() -> int:
    """Tasks runnable on the host now (procs_running of /proc/stat), this one included."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    raise KeyError("procs_running")


def window(exporter: Exporter, gpus: int, extra: int, seconds: float) -> Point:
    """The agent's readings over `seconds`: /metrics once a second, CPU from start to end."""
    durations: dict[float, float] = {}  # by the sample's timestamp: each sample once
    counts, running, pids, appeared = [], [], host_pids(), 0
    cpu_before, started = tree_cpu_seconds(exporter.pid), time.monotonic()
    while (now := time.monotonic()) < started + seconds:
        text = exporter.get()[0].decode()
        durations[values(text, LAST_SAMPLE, "")[""]] = values(text, DURATION, "")[""] * 1e3
        seen = host_pids()
        appeared, pids = appeared + len(seen - pids), seen
        counts.append(len(pids))
        running.append(runnable())
        time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
    elapsed = time.monotonic() - started
    cpu = (tree_cpu_seconds(exporter.pid) - cpu_before) * 60 / elapsed
    found = list(durations.values())
    return Point(
        gpus=gpus,
        extra=extra,
        processes=round(statistics.median(counts)),
        samples=len(found),
        sample_ms=statistics.median(found),
        sample_p90_ms=percentile(found, 0.9),
        cpu_s_min=cpu,
        pss_mb=tree_memory_mb(exporter.pid)[0],
        runnable=statistics.mean(running),
        new_per_s=appeared / elapsed,
    )


def measured(exporter: Exporter, gpus: int, extra: int, args: Namespace) -> Point:
    """A window; again (at most --retries times) while another job starts many processes."""
    point = window(exporter, gpus, extra, args.window)
    for _ in range(args.retries):
        if point.new_per_s <= CHURN_LIMIT:
            break
        print(
            f"  {point.new_per_s:.0f} processes started a second elsewhere: once more", flush=True
        )
        point = min(point, window(exporter, gpus, extra, args.window), key=lambda p: p.new_per_s)
    return point


def one_gpu_count(args: Namespace, work: Path, gpus: int, lifetime: int) -> list[Point]:
    """A fresh agent on `gpus` fake GPUs, measured at each host size; every process ended after."""
    binary, points = work / "sleepers", []
    with contextlib.ExitStack() as stack:
        needed = gpus * args.gpu_processes
        pids = stack.enter_context(sleepers(binary, needed, lifetime))
        if len(pids) < needed:
            raise SystemExit(f"only {len(pids)} of {needed} GPU processes started")
        fake = gpu_processes(work, Namespace(gpus=gpus, processes=args.gpu_processes), pids)
        exporter = stack.enter_context(agent(fake, args.agent_sources))
        added = 0
        for size in args.sizes:
            started = stack.enter_context(sleepers(binary, size - added, lifetime))
            added += len(started)
            time.sleep(args.settle)
            point = measured(exporter, gpus, added, args)
            points.append(point)
            print(
                f"  {gpus} GPUs, {added} extra processes ({point.processes} on the host): sample "
                f"{point.sample_ms:.2f} ms (p90 {point.sample_p90_ms:.2f}, {point.samples} "
                f"samples), CPU {point.cpu_s_min:.3f} s/min, {point.runnable:.1f} tasks runnable, "
                f"{point.new_per_s:.0f} new processes/s",
                flush=True,
            )
    return points


def process_cap(args: Namespace) -> int:
    """The agent's --max-processes: given here (to the agent by its environment), or its default."""
    if args.max_processes is not None:
        os.environ["KEPLER_BRIDGE_MAX_PROCESSES"] = str(args.max_processes)
    return config.load({}).max_processes


def main() -> None:
    args = arguments()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind as Ctrl-C does
    check_room(args)
    expected, cap = expected_seconds(args), process_cap(args)
    print(
        f"scaling: sizes {args.sizes} extra processes x {args.gpus} fake GPUs "
        f"({args.gpu_processes} processes each), --sources {args.agent_sources}, 1 s interval, "
        f"--max-processes {cap}, {args.window:g} s windows; about {expected / 60:.0f} min "
        f"(at most {expected_seconds(args, args.retries) / 60:.0f}); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if 0 < cap < max(args.sizes):
        print(f"  above {cap} processes the agent evicts the excess every sample (--max-processes)")
    # The longest a sleeping process lives, whatever happens to this script.
    lifetime = int(2 * expected_seconds(args, args.retries) + 600)
    points = []
    with tempfile.TemporaryDirectory(prefix="kb-scaling-") as directory:
        build(Path(directory), "sleepers", SLEEPERS_C)
        for gpus in sorted(set(args.gpus)):
            points += one_gpu_count(args, Path(directory), gpus, lifetime)
    print()
    print(report(points, cap))


if __name__ == "__main__":
    main()
