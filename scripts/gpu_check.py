"""Check kepler-bridge against nvidia-smi on a machine with an NVIDIA GPU (issue 16, part 6).

Run it through scripts/gpu-check.sh. It is read-only: it runs `kepler-bridge collect`,
`kepler-bridge serve` and nvidia-smi's query options, and never changes the card's settings
(no `nvidia-smi -pm/-pl/-mig/-ac/-rac/-lgc/-rgc/-r`, no NVML call that sets anything).
Exit 0: every compared value agrees; 1: one disagrees or kepler-bridge failed; 2: nothing
could be checked here (no GPU, no driver, or kepler-bridge's dependencies missing).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gpu_check_report as report
from gpu_check_fields import FIELDS, REMAPPED_ROWS, SMI_ONLY, parse_metrics, parse_smi_csv

EXIT_DISAGREE = 1
EXIT_CANNOT_CHECK = 2
# nvidia-smi is only ever asked these: queries, never a setting.
SMI_READ_ONLY = ("--help-query-gpu", "--query-gpu=", "--query-remapped-rows=", "--format=")
IMPORTS = "import kepler_bridge.cli, gunicorn, pynvml, prometheus_client, yaml, grpc"


class CannotCheck(Exception):
    """Nothing can be checked on this machine; the message says why and what to do."""


def smi(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run nvidia-smi with read-only arguments (anything else is refused here)."""
    refused = [arg for arg in args if not arg.startswith(SMI_READ_ONLY)]
    if refused:
        raise ValueError(f"gpu-check runs nvidia-smi read-only; refused {refused}")
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@dataclass
class Smi:
    """nvidia-smi's view, with the fields this nvidia-smi knows.

    The remapped rows are read once: they change rarely, and every nvidia-smi call costs
    a round trip to the driver that would widen the window around our reads."""

    known: set[str]
    remapped: dict[str, dict[str, str]]

    @classmethod
    def find(cls) -> Smi:
        if shutil.which("nvidia-smi") is None:
            raise CannotCheck(
                "no nvidia-smi on PATH: this check needs a machine with an NVIDIA GPU and its "
                "driver; nothing was checked"
            )
        listed = smi("--query-gpu=uuid", "--format=csv,noheader")
        uuids = [line for line in listed.stdout.split() if line.startswith("GPU-")]
        if listed.returncode != 0 or not uuids:
            said = (listed.stdout + listed.stderr).strip().splitlines() or ["no output"]
            raise CannotCheck(f"nvidia-smi lists no GPU here ({said[-1]}); nothing was checked")
        helped = smi("--help-query-gpu")
        wanted = {name for entry in FIELDS for name in entry.smi} | set(SMI_ONLY)
        known = set(re.findall(r'"([\w.\[\]]+)"', helped.stdout)) & wanted or wanted
        remap = smi(f"--query-remapped-rows=gpu_uuid,{','.join(REMAPPED_ROWS)}", _CSV)
        remapped = (
            parse_smi_csv(remap.stdout, ["uuid", *REMAPPED_ROWS]) if not remap.returncode else {}
        )
        return cls(known - set(REMAPPED_ROWS), remapped)

    def asked(self) -> list[str]:
        """Every field asked of nvidia-smi, the remapped rows' included where it has them."""
        return self.names() + (list(REMAPPED_ROWS) if self.remapped else [])

    def names(self) -> list[str]:
        """The --query-gpu names asked: the first known name of each field, and SMI_ONLY."""
        chosen = [next((n for n in entry.smi if n in self.known), "") for entry in FIELDS]
        return sorted({name for name in chosen if name} | (set(SMI_ONLY) & self.known))

    def read(self) -> dict[str, dict[str, str]]:
        """One read of every known field, by GPU uuid."""
        names = ["uuid", *self.names()]
        done = smi(f"--query-gpu={','.join(names)}", _CSV)
        rows = parse_smi_csv(done.stdout, names) if done.returncode == 0 else {}
        for uuid, values in self.remapped.items():
            rows.setdefault(uuid, {}).update(values)
        return rows


_CSV = "--format=csv,noheader,nounits"


def wheel_fits(name: str, version: tuple[int, int], machine: str) -> bool:
    """Whether a wheel file of the bundle runs on this Python and processor."""
    python, abi, platforms = name[: -len(".whl")].split("-")[-3:]
    own = f"cp{version[0]}{version[1]}"
    pythons = python.split(".")
    stable = abi == "abi3" and any(
        tag.startswith("cp3") and int(tag[3:]) <= version[1] for tag in pythons
    )
    if not (stable or own in pythons or any(tag.startswith("py3") for tag in pythons)):
        return False
    return any(tag == "any" or tag.endswith(f"_{machine}") for tag in platforms.split("."))


def python_path(wheels: str, source_tree: str, scratch: Path) -> list[str]:
    """The PYTHONPATH entries that let kepler-bridge run: the source tree, the unpacked wheels."""
    entries = [source_tree] if source_tree else []
    if wheels:
        site = scratch / "site"
        version = (sys.version_info.major, sys.version_info.minor)
        for wheel in sorted(Path(wheels).glob("*.whl")):
            if wheel_fits(wheel.name, version, platform.machine()):
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(site)
        entries.append(str(site))
    return entries


@dataclass
class Agent:
    """kepler-bridge run with this Python and `path` in front of its own."""

    path: list[str]
    log: Path

    @property
    def env(self) -> dict[str, str]:
        extra = os.pathsep.join(self.path)
        inherited = os.environ.get("PYTHONPATH", "")
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (extra, inherited) if p)}

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "kepler_bridge", *args]

    def check_imports(self) -> None:
        done = subprocess.run(
            [sys.executable, "-c", IMPORTS], env=self.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise CannotCheck(
                f"kepler-bridge cannot run with {sys.executable} ({reason}); build the bundle "
                "with `make gpu-check-bundle` where PyPI is reachable and carry dist/gpu-check/ "
                "here, or set PYTHON to a Python that has kepler-bridge's dependencies"
            )
        sys.path[:0] = self.path

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args), env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def serve(self, port: int) -> subprocess.Popen[bytes]:
        with self.log.open("wb") as log:
            args = ("serve", "--listen", f"127.0.0.1:{port}", *AGENT_ARGS)
            return subprocess.Popen(
                self.command(*args), env=self.env, stdout=log, stderr=subprocess.STDOUT
            )


AGENT_ARGS = ("--sources", "nvml", "--node-name", "gpu-check")


def collect(agent: Agent, nvidia: Smi) -> report.Reading:
    """One `kepler-bridge collect` between two nvidia-smi reads."""
    start, before = time.monotonic(), nvidia.read()
    done = agent.run("collect", "--prometheus", *AGENT_ARGS)
    after = nvidia.read()
    if done.returncode != 0:
        raise report.Failed(f"kepler-bridge collect exited {done.returncode}: {done.stderr}")
    return report.Reading(parse_metrics(done.stdout), before, after, time.monotonic() - start)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def serve(agent: Agent, nvidia: Smi, seconds: float, scrapes: int) -> list[report.Reading]:
    """`kepler-bridge serve` for `seconds`, /metrics scraped `scrapes` times between reads."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = agent.serve(port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, agent.log)
        start, readings = time.monotonic(), []
        for number in range(1, scrapes + 1):
            time.sleep(max(0.0, start + number * seconds / scrapes - time.monotonic()))
            began, before = time.monotonic(), nvidia.read()
            text = get(f"{url}/metrics")
            after = nvidia.read()
            span = time.monotonic() - began
            readings.append(report.Reading(parse_metrics(text), before, after, span))
        return readings
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise report.Failed(
                f"kepler-bridge serve exited {process.returncode}: {log.read_text()}"
            )
        try:
            get(f"{url}/readyz")
            return
        except OSError:
            time.sleep(0.3)
    raise report.Failed(f"kepler-bridge serve was not ready within 60 s: {log.read_text()}")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", default="", help="folder of the bundle's wheels")
    parser.add_argument("--source-tree", default="", help="a kepler-bridge checkout to run")
    parser.add_argument("--serve-seconds", type=float, default=30, help="0: collect only")
    parser.add_argument("--scrapes", type=int, default=6, help="scrapes of /metrics in that time")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    with tempfile.TemporaryDirectory(prefix="kepler-bridge-gpu-check-") as scratch:
        try:
            nvidia = Smi.find()
            path = python_path(args.wheels, args.source_tree, Path(scratch))
            agent = Agent(path, Path(scratch) / "serve.log")
            agent.check_imports()
        except CannotCheck as err:
            print(f"gpu-check: cannot check here: {err}", file=sys.stderr)
            return EXIT_CANNOT_CHECK
        try:
            header = report.header(agent.run("--version").stdout, agent.run("doctor", *AGENT_ARGS))
            once = collect(agent, nvidia)
            served = []
            if args.serve_seconds > 0 and args.scrapes > 0:
                served = serve(agent, nvidia, args.serve_seconds, args.scrapes)
        except (report.Failed, subprocess.TimeoutExpired, OSError) as err:
            print(f"gpu-check: kepler-bridge failed: {err}", file=sys.stderr)
            return EXIT_DISAGREE
        text, ok = report.render(header, nvidia.asked(), once, served)
        print(text)
        return 0 if ok else EXIT_DISAGREE


if __name__ == "__main__":
    raise SystemExit(main())
