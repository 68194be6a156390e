"""Cost of learning devices from containers' environment (no pod-resources: KubeEdge), in process.

A /proc tree under a temporary directory holds --containers containers of --processes processes
each (a cgroup file naming the container; for its lowest pid an environ of --services Kubernetes
service variables and NVIDIA_VISIBLE_DEVICES), and --gpus NVIDIA readings. It prints the thread
CPU time of `EnvironmentDevices.view` (the sampler calls it once per sample) in the steady state
(every container read already), the median of --blocks blocks of --samples calls, against the
same call where pod-resources answers (nothing to learn); then the one-off cost of reading a
container's environ, for that size and for the 1 MiB the reader reads at most.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kepler_bridge.kube.view import KubeView  # noqa: E402
from kepler_bridge.model import GpuReading, PodRef  # noqa: E402
from kepler_bridge.sampling import environment  # noqa: E402
from kepler_bridge.sampling.environment import EnvironmentDevices  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--processes", type=int, default=20, help="per container")
    parser.add_argument("--services", type=int, default=300, help="service variables per environ")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1000, help="per block")
    parser.add_argument("--blocks", type=int, default=7)
    return parser.parse_args()


def uuid(index: int) -> str:
    return f"GPU-fa4e0000-0000-4000-8000-{index:012x}"


def make_proc(root: Path, args: argparse.Namespace, environ_bytes: int = 0) -> list[tuple]:
    """The fake /proc; the process rows (pid, comm, container id) the CPU source would give."""
    services = b"".join(
        f"SVC{n}_SERVICE_HOST=10.96.{n // 250}.{n % 250}\0SVC{n}_PORT=tcp://10.96.0.1:80\0".encode()
        for n in range(args.services)
    )
    rows = []
    for container in range(args.containers):
        cid = f"{container:064x}"
        device = f"NVIDIA_VISIBLE_DEVICES={uuid(container % args.gpus)}\0".encode()
        data = services + device
        if environ_bytes:  # exactly the bound, the device variable last
            data = b"PAD=" + b"x" * (environ_bytes - len(device) - 5) + b"\0" + device
        for process in range(args.processes):
            pid = 1000 + container * args.processes + process
            (root / str(pid)).mkdir(parents=True)
            (root / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{container}/{cid}\n")
            if process == 0:  # the lowest pid: the one read
                (root / str(pid) / "environ").write_bytes(data)
            rows.append((pid, "worker", cid))
    return rows


def timed(call, samples: int, blocks: int) -> float:
    """Median thread CPU µs of one call."""
    costs = []
    for _ in range(blocks):
        started = time.thread_time()
        for _ in range(samples):
            call()
        costs.append((time.thread_time() - started) / samples * 1e6)
    return statistics.median(costs)


def first_reads(args: argparse.Namespace, environ_bytes: int) -> tuple[float, int]:
    """Thread CPU ms to read every container once, and how many samples that took."""
    with tempfile.TemporaryDirectory() as directory:
        rows = make_proc(Path(directory), args, environ_bytes)
        gpus = tuple(GpuReading(n, uuid(n), "nvidia", "A100") for n in range(args.gpus))
        ids = {cid for _, _, cid in rows}
        kube = KubeView({cid: PodRef("ml", cid[-6:], "main") for cid in ids}, {}, True)
        learned = EnvironmentDevices(directory)
        started, samples = time.thread_time(), 0
        while learned.reads < len(ids):
            learned.view(kube, ids, rows, gpus)
            samples += 1
        return (time.thread_time() - started) * 1e3, samples


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as directory:
        rows = make_proc(Path(directory), args)
        gpus = tuple(GpuReading(n, uuid(n), "nvidia", "A100") for n in range(args.gpus))
        ids = {cid for _, _, cid in rows}
        owners = {cid: PodRef("ml", cid[-6:], "main") for cid in ids}
        learning, answered = KubeView(owners, {}, True), KubeView(owners, {}, False)
        learned = EnvironmentDevices(directory)
        while learned.reads < len(ids):
            learned.view(learning, ids, rows, gpus)
        steady = timed(lambda: learned.view(learning, ids, rows, gpus), args.samples, args.blocks)
        idle = timed(lambda: learned.view(answered, ids, rows, gpus), args.samples, args.blocks)
    print(
        f"{args.containers} containers x {args.processes} processes, {args.gpus} GPUs, "
        f"{len(rows)} process rows"
    )
    print(f"steady state, per sample: {steady:.1f} µs (pod-resources answering: {idle:.1f} µs)")
    for size, label in ((0, f"{args.services} services"), (environment.MAX_ENVIRON_BYTES, "1 MiB")):
        total, samples = first_reads(args, size)
        print(
            f"first reads, environ of {label}: {total:.1f} ms for {args.containers} containers "
            f"({total / args.containers * 1e3:.0f} µs each) over {samples} samples "
            f"(at most {environment.MAX_READS} a sample)"
        )


if __name__ == "__main__":
    main()
