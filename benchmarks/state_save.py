"""Time of one counter-state save with 8 fake NVML GPUs x 16 processes, and the files' sizes.

The sampler saves its state after every sample, before publishing it: whole now and then, else
what the sample changed as a line appended to the log. Target (issue 18): at most 1 ms per
sample. Runs the sampler in this process (no HTTP) and times the saves alone, a sample before
each, whole ones included.
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
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakenvml import FakeNvml, build  # noqa: E402
from scaffold import make_config  # noqa: E402

if TYPE_CHECKING:
    from kepler_bridge.sampling.sampler import Sampler


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--samples", type=int, default=30, help="taken before timing")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    work = Path(tempfile.mkdtemp(prefix="kb-save-"))
    fake = FakeNvml(
        build(work), work / "nvml.conf", gpus=args.gpus, processes_per_gpu=args.processes
    )
    os.environ["FAKE_NVML_CONFIG"] = str(fake.config)  # read when the library loads
    from kepler_bridge.sampling import state_file
    from kepler_bridge.sampling.sampler import Sampler
    from kepler_bridge.store import SnapshotStore

    state = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    config = make_config(
        sources="nvml", nvml_library=str(fake.library), kube_source="off", pod_resources_socket=""
    )
    sampler = Sampler(config, SnapshotStore(), state_dir=state)
    try:
        for _ in range(args.samples):
            sampler.sample()
            sampler._save()
        # Blocks of 100 saves: the fastest block is the cost, the median shows the machine's noise.
        blocks = [saves_ms(sampler, 100) for _ in range(15)]
        size = os.path.getsize(os.path.join(state, state_file.FILE))
        log = os.path.getsize(os.path.join(state, state_file.LOG))
        sampler.sample()
        sampler._save()
        line = os.path.getsize(os.path.join(state, state_file.LOG)) - log
    finally:
        sampler.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"state save, {args.gpus} GPUs x {args.processes} processes: "
        f"{min(blocks):.3f} ms (median of blocks {statistics.median(blocks):.3f} ms), "
        f"whole {size / 1024:.1f} KiB, a logged save {line / 1024:.1f} KiB"
    )


def saves_ms(sampler: Sampler, count: int) -> float:
    """Mean ms of `count` saves, each after a sample."""
    total = 0.0
    for _ in range(count):
        sampler.sample()
        started = time.perf_counter()
        sampler._save()
        total += time.perf_counter() - started
    return total * 1e3 / count


if __name__ == "__main__":
    main()
