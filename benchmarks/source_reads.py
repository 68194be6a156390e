"""What each source's read costs: nvml on the fake NVML (8 GPUs x 16 processes), ebpf and procfs
on this host, optionally with extra sleeping processes; and NVML calls per GPU per sample.

Each figure is the median over blocks of reads (100 by default) of the CPU time per read (this
process, kernel time included: the eBPF task iterator runs in the kernel), of the wall time, and
of the CPU time the sanitiser then takes over the reading (sanitize.reading, as every sample does);
for the CPU sources also per process, which stays comparable when other jobs start or end
processes meanwhile. Runs the sources in this process (no HTTP, no sampler), the fake NVML
without its call-statistics file (as benchmarks/peers.py): calls are counted in process. Issue
18 budgets the whole sample at 3 ms for 8 GPUs x 16 processes and 10 ms with 3000 processes on
eBPF.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sleepers  # noqa: E402

from fakenvml import FakeNvml, build  # noqa: E402
from scaffold import make_config  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--extra", type=int, default=0, help="sleeping processes to add")
    parser.add_argument("--sources", default="nvml,ebpf,procfs")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reads", type=int, default=100, help="per block")
    parser.add_argument("--interval", type=float, default=1.0, help="for calls averaged")
    return parser.parse_args()


def timed(source: Any, args: argparse.Namespace) -> tuple[float, float, float]:
    """Median CPU and wall ms per read, and CPU ms per sanitising of it, over the blocks."""
    from kepler_bridge.sampling import sanitize

    for _ in range(5):
        sanitize.reading(source.read())
    cpu, wall, cleaning = [], [], []
    for _ in range(args.blocks):
        started, used, cleaned, waited = time.perf_counter(), time.process_time(), 0.0, 0.0
        for _ in range(args.reads):
            reading = source.read()
            before, at = time.process_time(), time.perf_counter()
            sanitize.reading(reading)
            cleaned += time.process_time() - before
            waited += time.perf_counter() - at
        cpu.append((time.process_time() - used - cleaned) / args.reads * 1e3)
        wall.append((time.perf_counter() - started - waited) / args.reads * 1e3)
        cleaning.append(cleaned / args.reads * 1e3)
    return statistics.median(cpu), statistics.median(wall), statistics.median(cleaning)


def nvml_calls(source: Any, gpus: int, reads: int = 20) -> float:
    """NVML calls per GPU per read, by the fake's in-process counter of each function pynvml
    looked up (the read's one look for XID events included)."""
    import pynvml

    count = pynvml.nvmlLib.fakenvml_call_count
    count.restype = ctypes.c_ulonglong
    names = list(pynvml._nvmlGetFunctionPointer_cache)
    before = sum(count(name.encode()) for name in names)
    for _ in range(reads):
        source.read()
    return (sum(count(name.encode()) for name in names) - before) / reads / gpus


def nvml(fake: FakeNvml, args: argparse.Namespace) -> str:
    from kepler_bridge.sources.nvml.source import NvmlSource

    config = make_config(nvml_library=str(fake.library))
    source = NvmlSource(config)
    source.start()
    try:
        cpu, wall, cleaning = timed(source, args)
        live = nvml_calls(source, args.gpus)
        source.configure(make_config(nvml_library=str(fake.library), nvml_counter_interval="0"))
        every = nvml_calls(source, args.gpus)
    finally:
        source.stop()
    averaged = live + (every - live) * args.interval / config.nvml_counter_interval
    return (
        f"nvml   {args.gpus} GPUs x {args.processes}: {cpu:.2f} ms CPU ({wall:.2f} ms wall) per "
        f"read, sanitising {cleaning:.2f} ms CPU; NVML calls per GPU per sample {live:.1f}, "
        f"{every:.1f} when the slow counters are read, {averaged:.1f} averaged at "
        f"{args.interval:g} s / {config.nvml_counter_interval:g} s"
    )


def processes(name: str, args: argparse.Namespace) -> str:
    from kepler_bridge.sources.ebpf.source import EbpfSource
    from kepler_bridge.sources.procfs import ProcfsSource

    kind = EbpfSource if name == "ebpf" else ProcfsSource
    source = kind(make_config())
    try:
        source.start()
    except Exception as err:  # noqa: BLE001 - shown, and the other sources still measured
        return f"{name:6} not measured: {err}"
    try:
        cpu, wall, cleaning = timed(source, args)
        count = len(source.read().processes)
    finally:
        source.stop()
    return (
        f"{name:6} {count} processes: {cpu:.2f} ms CPU ({wall:.2f} ms wall) per read, "
        f"{cpu / count * 1e3:.2f} us CPU per process, sanitising {cleaning:.2f} ms CPU"
    )


def main() -> None:
    args = arguments()
    work = Path(tempfile.mkdtemp(prefix="kb-reads-"))
    fake = FakeNvml(
        build(work), work / "nvml.conf", gpus=args.gpus, processes_per_gpu=args.processes
    )
    os.environ["FAKE_NVML_CONFIG"] = str(fake.config)  # read when the library loads
    # The fake re-reads a config younger than a second at every call (tests/fakenvml/README.md).
    time.sleep(1.1)
    with ExitStack() as stack:
        if args.extra:
            binary = sleepers.build(work, "sleepers", sleepers.SLEEPERS_C)
            stack.enter_context(sleepers.sleepers(binary, args.extra, 3600))
        for name in args.sources.split(","):
            print(nvml(fake, args) if name == "nvml" else processes(name, args), flush=True)


if __name__ == "__main__":
    main()
