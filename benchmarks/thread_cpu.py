"""Where the agent's CPU goes, thread by thread (issue 18's CPU target).

Starts the agent as benchmarks/peers.py does (`--sources auto`, fake NVML --gpus x --processes
real sleeping processes, 1 s interval), lets it settle, then reads each thread's time on a CPU and
its runs (/proc/PID/task/TID/schedstat, nanoseconds, exact) of the master and the worker over
--seconds, scraped (gzip) every --scrape-every s, or never with 0. Prints a row per thread, CPU
s/min and wake-ups per second, named by the worker's own thread names where `py-spy` can read
them (`pip install py-spy`; without it, by thread id), and the total. Each wake-up of an idle
Python thread costs some 0.1-0.2 ms of CPU on a 2-vCPU VM: a thread that wakes every second
costs about 0.01 s/min.

    python benchmarks/thread_cpu.py [--seconds 60] [--scrape-every 15] [--extra-processes 0]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from peers import LIFETIME, agent, gpu_processes, tree  # noqa: E402
from sleepers import SLEEPERS_C, build, sleepers  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scrape-every", type=float, default=15, help="0: no scrape")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--extra-processes", type=int, default=0)
    return parser.parse_args()


def schedstat(master: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (ns on a CPU, runs) of every thread of the agent's processes (peers.py's
    `tree`: the master, the worker and any child of theirs running now)."""
    found = {}
    for pid in tree(master):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                ran, _, runs = task.joinpath("schedstat").read_text().split()[:3]
                found[(pid, int(task.name))] = (int(ran), int(runs))
    return found


def thread_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name of a process, from `py-spy dump`; {} without py-spy."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return {}
    dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True).stdout
    return {
        int(tid): name for tid, name in re.findall(r'^Thread (\d+) \(\w+\): "(.*)"$', dump, re.M)
    }


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory(prefix="kb-threads-") as directory:
        work = Path(directory)
        build(work, "sleepers", SLEEPERS_C)
        with contextlib.ExitStack() as stack:
            pids = stack.enter_context(
                sleepers(work / "sleepers", args.gpus * args.processes, LIFETIME)
            )
            fake = gpu_processes(work, args, pids)
            if args.extra_processes:
                stack.enter_context(sleepers(work / "sleepers", args.extra_processes, LIFETIME))
            running = stack.enter_context(agent(fake, "auto"))
            time.sleep(5)
            (worker,) = Path(f"/proc/{running.pid}/task/{running.pid}/children").read_text().split()
            names = {**thread_names(int(worker)), running.pid: "master"}
            before, started = schedstat(running.pid), time.monotonic()
            end = started + args.seconds
            while time.monotonic() < end:
                if args.scrape_every:
                    running.get(gzip=True)
                time.sleep(min(args.scrape_every or args.seconds, max(0.0, end - time.monotonic())))
            after, elapsed = schedstat(running.pid), time.monotonic() - started
    rows = []
    for key, (ran, runs) in after.items():
        ran_before, runs_before = before.get(key, (0, 0))
        name = names.get(key[1], f"tid {key[1]}")
        rows.append(((ran - ran_before) / 1e9 * 60 / elapsed, (runs - runs_before) / elapsed, name))
    scraped = f"scraped every {args.scrape_every:g} s" if args.scrape_every else "not scraped"
    print(
        f"kepler-bridge threads, {args.gpus} GPUs x {args.processes} processes, "
        f"{args.extra_processes} more, 1 s interval, {scraped}, {elapsed:.0f} s"
    )
    print(f"{'thread':36} {'CPU s/min':>10} {'runs/s':>8}")
    for cpu, runs, name in sorted(rows, reverse=True):
        print(f"{name:36} {cpu:10.4f} {runs:8.1f}")
    print(f"{'total':36} {sum(row[0] for row in rows):10.4f}")


if __name__ == "__main__":
    main()
