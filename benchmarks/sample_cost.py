"""Cost of one sample and of one counter-state save, in the process (no HTTP), with real sources.

A Sampler reads the fake NVML (--gpus x --processes, those processes real sleeping children) and
the CPU source of --sources (procfs, or ebpf as root), with --extra-processes more sleeping
processes on the host. The fake's PCIe throughput call measures for 20 ms before it answers, as
NVML's does. It prints, per block of --samples samples, the median of the blocks: wall and thread
CPU ms per `Sampler.sample` (what kepler_bridge_sample_duration_seconds reports; the mean, and the
block's median, which leaves out a block's few slow samples), the part of its wall time the thread
waited, runnable, for a CPU (schedstat; the rest of the gap to its CPU time it was blocked, or, on
a VM, its virtual CPU was taken by the hypervisor: steal), and per state save, how much of a sample
went to reading the sources and to sanitising what they gave (the rest is counters, owners,
attribution and the snapshot), and how many processes the CPU source reported. Targets (issue 18):
a sample at most 3 ms at 8 GPUs x 16 processes and 10 ms with 3000 more processes on eBPF, a save
at most 1 ms.

The CPU source sees every process of the host, so other work on the machine changes the figure;
run it in a pid namespace of its own for procfs (`unshare --pid --fork --mount-proc`), which eBPF
refuses. --worker-gc sets the garbage collector as the agent's worker does once its sources have
started (http/server.py: gc.freeze, a higher threshold for the youngest generation); without it,
Python's defaults. --pace S sleeps S seconds between samples, as the agent does (a sample after a
second asleep finds colder caches than one straight after another). --profile N prints the N
functions that cost most (cProfile, own time). A last line gives the render of the last snapshot
to /metrics bytes, text and OpenMetrics, by our writer and by prometheus_client's (the median of
--renders each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sleepers import SLEEPERS_C, build, sleepers  # noqa: E402

from fakenvml import NVML_PCIE_THROUGHPUT_MS, FakeNvml, default_process  # noqa: E402
from fakenvml import build as build_fakenvml  # noqa: E402
from scaffold import make_config  # noqa: E402

if TYPE_CHECKING:
    from kepler_bridge.model import Snapshot
    from kepler_bridge.sampling.sampler import Sampler


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", default="nvml,procfs", help="nvml,procfs or nvml,ebpf")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--extra-processes", type=int, default=0)
    parser.add_argument("--samples", type=int, default=100, help="per block")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--worker-gc", action="store_true", help="the worker's collector settings")
    parser.add_argument("--max-processes", type=int, help="--max-processes (default: its default)")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--renders", type=int, default=30, help="renders timed of each kind")
    parser.add_argument(
        "--pace", type=float, default=0.0, help="seconds between samples, as the agent's interval"
    )
    return parser.parse_args()


def timed(call: Callable[[], object]) -> tuple[float, float]:
    """Wall and thread CPU seconds of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return time.perf_counter() - wall, time.thread_time() - cpu


class Stage:
    """Wall seconds spent in one function, which it wraps where it is looked up."""

    def __init__(self, owner: object, name: str) -> None:
        self.seconds, self.function = 0.0, getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args: object) -> object:
        started = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            self.seconds += time.perf_counter() - started


def blocks(sampler: Sampler, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per block, the mean ms of each measure; the blocks' list per measure."""
    from kepler_bridge.sampling import sanitize, slots
    from kepler_bridge.turns import cpu_seconds

    found: dict[str, list[float]] = {}
    reads, cleaning = Stage(slots, "read_clean"), Stage(sanitize, "reading")
    for _ in range(args.blocks):
        totals = dict.fromkeys(("sample", "sample CPU", "sample runnable", "save", "save CPU"), 0.0)
        reads.seconds = cleaning.seconds = 0.0
        walls = []
        for _ in range(args.samples):
            waited = cpu_seconds()[1]
            wall, cpu = timed(sampler.sample)
            walls.append(wall)
            totals["sample runnable"] += cpu_seconds()[1] - waited
            totals["sample"] += wall
            totals["sample CPU"] += cpu
            wall, cpu = timed(sampler._save)
            totals["save"] += wall
            totals["save CPU"] += cpu
            time.sleep(args.pace)
        totals["of which reading"] = reads.seconds - cleaning.seconds
        totals["sanitising"] = cleaning.seconds
        for name, seconds in totals.items():
            found.setdefault(name, []).append(seconds * 1e3 / args.samples)
        found.setdefault("sample median", []).append(statistics.median(walls) * 1e3)
    return found


def profiled(sampler: Sampler, args: argparse.Namespace) -> dict[str, list[float]]:
    """`blocks` under cProfile; prints its --profile costliest functions by own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    found = profile.runcall(blocks, sampler, args)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    return found


def renders(snapshot: Snapshot, count: int) -> str:
    """Median ms to make the families of `snapshot` and to write them, text and OpenMetrics, by
    our writer and by the library's."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    from kepler_bridge.exposition import prometheus, text_format

    families = list(prometheus.SnapshotCollector(snapshot).collect())
    registry = text_format.Families(families)

    kinds = {
        "families": lambda: list(prometheus.SnapshotCollector(snapshot).collect()),
        "text": lambda: text_format.generate(families),
        "text by prometheus_client": lambda: generate_latest(registry),
        "OpenMetrics": lambda: text_format.generate(families, openmetrics=True),
        "OpenMetrics by prometheus_client": lambda: generate_openmetrics(registry),
    }
    medians = {
        name: statistics.median(timed(call)[0] for _ in range(count)) * 1e3
        for name, call in kinds.items()
    }
    shown = ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
    return f"render of {len(text_format.generate(families))} bytes: {shown}"


def main() -> None:
    args = arguments()
    work = Path(tempfile.mkdtemp(prefix="kb-sample-"))
    state = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    gpu_processes = args.gpus * args.processes
    binary = build(work, "sleepers", SLEEPERS_C)
    try:
        with sleepers(binary, gpu_processes + args.extra_processes, 3600) as pids:
            fake = FakeNvml(build_fakenvml(work), work / "nvml.conf", gpus=args.gpus)
            fake.set(pcie_throughput_ms=NVML_PCIE_THROUGHPUT_MS)
            for gpu in range(args.gpus):
                mine = pids[gpu * args.processes : (gpu + 1) * args.processes]
                fake.processes(gpu, [default_process(pid, n) for n, pid in enumerate(mine)])
            os.environ["FAKE_NVML_CONFIG"] = str(fake.config)  # read when the library loads
            # The fake re-reads a config younger than a second at every call (its README).
            time.sleep(1.1)
            run(args, str(fake.library), state)
    finally:
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, library: str, state: str) -> None:
    from kepler_bridge.sampling.sampler import Sampler
    from kepler_bridge.store import SnapshotStore

    cap = {} if args.max_processes is None else {"max_processes": args.max_processes}
    config = make_config(
        sources=args.sources,
        nvml_library=library,
        kube_source="off",
        pod_resources_socket="",
        **cap,
    )
    sampler = Sampler(config, SnapshotStore(), state_dir=state)
    if args.worker_gc:
        from kepler_bridge.http.server import settle_collector

        settle_collector()
    try:
        failed = [f"{slot.name}: {slot.error}" for slot in sampler.slots if not slot.started]
        if failed:
            raise SystemExit(f"sources did not start: {'; '.join(failed)}")
        for _ in range(20):  # warm up: every counter seen, every table written once
            sampler.sample()
            sampler._save()
        found = profiled(sampler, args) if args.profile else blocks(sampler, args)
        counted = max(len(slot.last.processes) for slot in sampler.slots)
        rendered = renders(sampler.sample(), args.renders)
    finally:
        sampler.stop()
    figures = ", ".join(
        f"{name} {statistics.median(values):.2f} ms" for name, values in found.items()
    )
    print(
        f"{args.sources}, {args.gpus} GPUs x {args.processes} processes, "
        f"{args.extra_processes} more ({counted} processes counted): {figures} "
        f"(median of {args.blocks} blocks of {args.samples})"
    )
    print(rendered)


if __name__ == "__main__":
    main()
