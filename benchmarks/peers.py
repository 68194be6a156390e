"""kepler-bridge beside nvitop-exporter and node_exporter on the same fake NVML and host (issue 18).

Starts the three on loopback ports, the GPUs' processes real sleeping children whose pids the fake
NVML reports (its PCIe throughput call measuring for 20 ms, as NVML's), and prints one table per
host: 8 GPUs x 16 processes, then with 3000 more sleeping processes. Per exporter: scrape p50/p99
(sequential, the exporters interleaved round by round so drift hits all alike), req/s with 8 `wrk`
clients, CPU (utime + stime of every process of the exporter, reaped children included) over
--duration s at a 1 s interval while scraped with gzip every 15 s, PSS and RSS summed over its
processes, bytes per scrape plain and gzip, and the ratios kepler-bridge/peer; at the end one line
with the issue's targets. Needs wrk, prometheus-node-exporter (Debian) and nvitop-exporter in
.venv-peers (`make bench` installs them); root for the agent's eBPF source (else it counts CPU from
procfs).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_http import memory_kib, percentile  # noqa: E402
from peers_report import AGENT, NODE, NVITOP, Reading, Run, table, targets_line  # noqa: E402
from sleepers import SLEEPERS_C, build, sleepers  # noqa: E402

from agent import Agent  # noqa: E402
from fakenvml import NVML_PCIE_THROUGHPUT_MS, FakeNvml, default_process  # noqa: E402
from fakenvml import build as build_fakenvml  # noqa: E402
from scaffold import free_port, values, wait_for  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
SCRAPE_EVERY = 15.0  # Prometheus' default, during the CPU window
LIFETIME = 4 * 3600  # the longest any sleeping process lives, whatever happens to this script


class Exporter:
    """One running exporter: its name, loopback port and the pid its processes descend from."""

    def __init__(self, name: str, port: int, pid: int) -> None:
        self.name, self.port, self.pid = name, port, pid
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def get(self, path: str = "/metrics", gzip: bool = False) -> tuple[bytes, str]:
        """The body as sent, and its Content-Encoding, on the kept-alive connection."""
        headers = {"Accept-Encoding": "gzip"} if gzip else {}
        try:
            self.connection.request("GET", path, headers=headers)
            response = self.connection.getresponse()
        except (ConnectionError, http.client.HTTPException):
            self.connection.close()  # the peer closed an idle connection: once more, anew
            self.connection.request("GET", path, headers=headers)
            response = self.connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"{self.name} {path} answered {response.status}: {body[:200]!r}")
        return body, response.getheader("Content-Encoding", "")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="whole runs; medians when > 1")
    parser.add_argument("--duration", type=float, default=60, help="CPU window, seconds")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--scrapes", type=int, default=300, help="sequential rounds")
    parser.add_argument("--load-seconds", type=int, default=10, help="wrk run per exporter")
    parser.add_argument("--sample-polls", type=int, default=20, help="sample duration reads")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--extra-processes", type=int, default=3000)
    parser.add_argument("--agent-sources", default="auto", help="kepler-bridge --sources")
    parser.add_argument(
        "--nvitop-exporter", default=str(ROOT / ".venv-peers" / "bin" / "nvitop-exporter")
    )
    parser.add_argument("--node-exporter", default="prometheus-node-exporter")
    args = parser.parse_args()
    if not 0 <= args.extra_processes <= 20000 or not 1 <= args.gpus * args.processes <= 4096:
        parser.error("at most 20000 extra processes and 4096 GPU processes")
    if args.quick:
        args.duration, args.scrapes, args.load_seconds, args.sample_polls = 10, 30, 2, 3
    return args


@dataclass(frozen=True)
class Setup:
    """The scratch folder, and the programs run beside the agent."""

    work: Path
    nvitop: str
    node: str
    wrk: str


def tools(args: argparse.Namespace, work: Path) -> Setup:
    """The programs, or the command that installs them."""
    nvitop = args.nvitop_exporter if Path(args.nvitop_exporter).is_file() else None
    node, wrk = shutil.which(args.node_exporter), shutil.which("wrk")
    if nvitop is None:
        raise SystemExit(f"{args.nvitop_exporter} is missing: run `make .venv-peers/.installed`")
    if node is None or wrk is None:
        raise SystemExit("install them: bash scripts/apt-install.sh prometheus-node-exporter wrk")
    return Setup(work, nvitop, node, wrk)


def tree(pid: int) -> list[int]:
    """`pid` and every process below it, now."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(child) for child in (task / "children").read_text().split()]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of the processes of `tree(pid)`."""
    total = 0
    for member in tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(field) for field in fields[11:15])
    return total / TICKS


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """PSS and RSS in MB (10**6 bytes) summed over `tree(pid)`."""
    pss = rss = 0
    for member in tree(pid):
        with contextlib.suppress(OSError):
            pss, rss = pss + memory_kib(member, "Pss"), rss + memory_kib(member, "Rss")
    return pss * 1024 / 1e6, rss * 1024 / 1e6


def interleaved(exporters: list[Exporter], rounds: int) -> dict[str, list[float]]:
    """Seconds per plain /metrics scrape, one scrape of each exporter per round, order rotated."""
    timings: dict[str, list[float]] = {exporter.name: [] for exporter in exporters}
    for round_ in range(rounds + 10):  # the first 10 rounds warm up
        shift = round_ % len(exporters)
        for exporter in exporters[shift:] + exporters[:shift]:
            started = time.perf_counter()
            exporter.get()
            if round_ >= 10:
                timings[exporter.name].append(time.perf_counter() - started)
    return timings


def throughput(wrk: str, port: int, seconds: int) -> tuple[float, str]:
    """Requests per second of /metrics with 8 keep-alive clients, and what wrk saw fail."""
    out = subprocess.run(
        [
            wrk,
            "-t2",
            "-c8",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            f"http://127.0.0.1:{port}/metrics",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert rate is not None, out
    errors = re.findall(r"Non-2xx or 3xx responses: \d+|Socket errors: .*", out)
    return float(rate.group(1)), "; ".join(errors)


def cpu_window(exporters: list[Exporter], seconds: float) -> dict[str, float]:
    """CPU seconds a minute of each exporter over `seconds`, all scraped (gzip) every 15 s."""
    before = {exporter.name: tree_cpu_seconds(exporter.pid) for exporter in exporters}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for exporter in exporters:
            exporter.get(gzip=True)
        time.sleep(min(SCRAPE_EVERY, max(0.0, end - time.monotonic())))
    return {
        exporter.name: (tree_cpu_seconds(exporter.pid) - before[exporter.name]) * 60 / seconds
        for exporter in exporters
    }


def sample_ms(agent: Exporter, polls: int) -> float:
    """Median of kepler_bridge_sample_duration_seconds over `polls` reads a second apart, in ms."""
    found = []
    for _ in range(polls):
        text = agent.get()[0].decode()
        found.append(values(text, "kepler_bridge_sample_duration_seconds", "")[""] * 1e3)
        time.sleep(1.0)
    return sorted(found)[len(found) // 2]


def scenario(exporters: list[Exporter], wrk: str, args: argparse.Namespace) -> Run:
    """Every measure of every exporter on the host as it is now."""
    timings = interleaved(exporters, args.scrapes)
    rates = {
        exporter.name: throughput(wrk, exporter.port, args.load_seconds) for exporter in exporters
    }
    cpu = cpu_window(exporters, args.duration)
    sample = sample_ms(exporters[0], args.sample_polls)
    run = {}
    for exporter in exporters:
        plain, gzipped = exporter.get()[0], exporter.get(gzip=True)
        if gzipped[1] != "gzip":
            raise RuntimeError(f"{exporter.name} sent no gzip for Accept-Encoding: gzip")
        pss, rss = tree_memory_mb(exporter.pid)
        rate, failed = rates[exporter.name]
        if failed:
            print(f"{exporter.name}: wrk saw {failed}", file=sys.stderr)
        run[exporter.name] = Reading(
            p50_ms=percentile(timings[exporter.name], 0.5) * 1e3,
            p99_ms=percentile(timings[exporter.name], 0.99) * 1e3,
            rps=rate,
            cpu_s_min=cpu[exporter.name],
            pss_mb=pss,
            rss_mb=rss,
            plain_kib=len(plain) / 1024,
            gzip_kib=len(gzipped[0]) / 1024,
            sample_ms=sample if exporter.name == AGENT else None,
        )
    return run


def cpu_source_up(states: dict[str, str], sources: str) -> bool:
    """Whether nvml is up, and the source counting process CPU where the agent runs one."""
    counts_cpu = {"auto", "ebpf", "procfs"} & set(sources.split(","))
    cpu_up = "up" in (states.get("ebpf"), states.get("procfs"))
    return states.get("nvml") == "up" and (cpu_up or not counts_cpu)


@contextlib.contextmanager
def agent(fake: FakeNvml, sources: str) -> Iterator[Exporter]:
    """kepler-bridge (gunicorn master and worker) at a 1 s interval on the fake NVML."""
    env = {"FAKE_NVML_CONFIG": str(fake.config)}  # no call statistics: they cost the fake
    args = ("--sources", sources, "--nvml-library", str(fake.library), "--interval", "1s")
    with Agent(*args, env=env, timeout=120) as running:
        assert running.process is not None  # started by the with
        wait_for(
            lambda: cpu_source_up(running.source_states(), sources),
            120,
            "kepler-bridge: nvml and the CPU source up",
            ignore=(OSError,),
            log=running.output,
        )
        up = sorted(name for name, state in running.source_states().items() if state == "up")
        print(f"  kepler-bridge sources up: {', '.join(up)}", flush=True)
        yield Exporter(AGENT, running.port, running.process.pid)


@contextlib.contextmanager
def peer(
    name: str, command: list[str], env: dict[str, str], port: int, needle: bytes, log: Path
) -> Iterator[Exporter]:
    """A peer exporter, ready once its /metrics holds `needle`; stopped (TERM, then KILL) after."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
    exporter = Exporter(name, port, process.pid)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}: {log.read_text()[-2000:]}")
        return needle in exporter.get()[0]

    try:
        wait_for(ready, 120, f"{name} ready", ignore=(OSError, http.client.HTTPException))
        yield exporter
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def gpu_processes(work: Path, args: argparse.Namespace, pids: list[int]) -> FakeNvml:
    """The fake NVML with `args.processes` of these pids on each of `args.gpus` GPUs."""
    fake = FakeNvml(build_fakenvml(work), work / "nvml.conf", gpus=args.gpus)
    fake.set(pcie_throughput_ms=NVML_PCIE_THROUGHPUT_MS)
    for gpu in range(args.gpus):
        mine = pids[gpu * args.processes : (gpu + 1) * args.processes]
        fake.processes(gpu, [default_process(pid, n) for n, pid in enumerate(mine)])
    return fake


def exporters(
    stack: contextlib.ExitStack, setup: Setup, sources: str, fake: FakeNvml, pid: int
) -> list[Exporter]:
    """The three exporters, started on `stack`; the peers' readiness: a GPU process shown."""
    nvitop_port, node_port = free_port(), free_port()
    nvitop_env = {"LD_LIBRARY_PATH": str(fake.library.parent), "FAKE_NVML_CONFIG": str(fake.config)}
    return [
        stack.enter_context(agent(fake, sources)),
        stack.enter_context(
            peer(
                NVITOP,
                [setup.nvitop, "--bind-address", "127.0.0.1", "--port", str(nvitop_port)]
                + ["--interval", "1"],
                nvitop_env,
                nvitop_port,
                f'pid="{pid}"'.encode(),
                setup.work / "nvitop-exporter.log",
            )
        ),
        stack.enter_context(
            peer(
                NODE,
                [setup.node, f"--web.listen-address=127.0.0.1:{node_port}"],
                {},
                node_port,
                b"node_cpu_seconds_total",
                setup.work / "node_exporter.log",
            )
        ),
    ]


def one_run(args: argparse.Namespace, setup: Setup, names: tuple[str, str]) -> dict[str, Run]:
    """Both hosts, the exporters started afresh; every process started here ended after."""
    binary = setup.work / "sleepers"
    settle = 2 if args.quick else 5
    with contextlib.ExitStack() as stack:
        needed = args.gpus * args.processes
        pids = stack.enter_context(sleepers(binary, needed, LIFETIME))
        if len(pids) < needed:
            raise SystemExit(f"only {len(pids)} of {needed} GPU processes started")
        fake = gpu_processes(setup.work, args, pids)
        running = exporters(stack, setup, args.agent_sources, fake, pids[-1])
        time.sleep(settle)
        found = {names[0]: scenario(running, setup.wrk, args)}
        extra = stack.enter_context(sleepers(binary, args.extra_processes, LIFETIME))
        print(f"  {len(extra)} extra sleeping processes", flush=True)
        time.sleep(settle)
        found[names[1]] = scenario(running, setup.wrk, args)
    return found


def versions(setup: Setup) -> str:
    """The three exporters' versions."""
    nvitop = subprocess.run([setup.nvitop, "--version"], capture_output=True, text=True)
    node = subprocess.run([setup.node, "--version"], capture_output=True, text=True)
    node_version = re.search(r"version (\S+)", node.stdout + node.stderr)
    return (
        f"kepler-bridge {version('kepler-bridge')}, {' '.join(nvitop.stdout.split()[:2])}, "
        f"node_exporter {node_version.group(1) if node_version else '?'}"
    )


def main() -> None:
    args = arguments()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind as Ctrl-C does
    host = f"{args.gpus}x{args.processes}"
    names = (host, f"{host}+{args.extra_processes}")
    results = []
    with tempfile.TemporaryDirectory(prefix="kb-peers-") as directory:
        setup = tools(args, Path(directory))
        print(
            f"peers: {versions(setup)}; fake NVML {args.gpus} GPUs x {args.processes} sleeping "
            f"processes, 1 s interval; {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        build(setup.work, "sleepers", SLEEPERS_C)
        for number in range(args.runs):
            print(f"run {number + 1} of {args.runs}", flush=True)
            results.append(one_run(args, setup, names))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    scenarios = {name: [run[name] for run in results] for name in names}
    titles = (
        f"{args.gpus} fake GPUs x {args.processes} sleeping processes",
        f"the same host with {args.extra_processes} more sleeping processes",
    )
    for title, runs in zip(titles, scenarios.values()):
        print()
        print(table(f"{title} (kb: kepler-bridge; ratios kb/peer)", runs))
    print()
    print(targets_line(scenarios, {names[0]: 3.0, names[1]: 10.0}))


if __name__ == "__main__":
    main()
