"""What each process of a running agent has loaded (issue 18): the master (supervisor.py, run as
`python -S`) the standard library only, the worker what its sources and features use.

Seen from outside the agent: with PYTHONPROFILEIMPORTTIME set, each interpreter prints a header
line and then its imports: `kepler-bridge serve`'s, then the master's it execs into, then the
worker's; /proc/PID/maps shows the shared libraries of each.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml

pytestmark = pytest.mark.e2e

# Neither process needs these here: no web framework, no config file, no pod-resources.
NOWHERE = ("flask", "werkzeug", "jinja2", "yaml", "grpc", "google.protobuf")
# The shared libraries of grpc, bcc and PyYAML, and those the worker's modules load.
NOT_MAPPED_IN_MASTER = ("cygrpc", "libbcc", "_yaml", "_ctypes", "_ssl", "_socket", "_json")
HEADER = "import time: self [us] | cumulative | imported package"
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", re.MULTILINE)


def _under(names: set[str], packages: tuple[str, ...]) -> set[str]:
    return {name for name in names for package in packages if f"{name}.".startswith(f"{package}.")}


def test_the_master_holds_the_standard_library_only(fake_nvml: FakeNvml) -> None:
    args = ("--sources", "nvml", "--nvml-library", str(fake_nvml.library), "--interval", "0.25s")
    with Agent(*args, env={**fake_nvml.env(), "PYTHONPROFILEIMPORTTIME": "1"}) as agent:
        assert agent.process is not None
        (worker,) = agent.worker_pids()
        command = Path(f"/proc/{agent.process.pid}/cmdline").read_bytes().split(b"\0")
        master_maps = Path(f"/proc/{agent.process.pid}/maps").read_text()
        worker_maps = Path(f"/proc/{worker}/maps").read_text()
        _, serve, master, worker_own, *_ = agent.output().split(HEADER) + [""] * 4
    assert command[1:2] == [b"-S"] and command[2].endswith(b"/kepler_bridge/http/supervisor.py")
    assert "kepler_bridge.cli" in IMPORT_LINE.findall(serve)
    master_modules = set(IMPORT_LINE.findall(master))
    assert {"select", "_signal"} <= master_modules
    # The heavy parts of the standard library the master goes without (typing alone is 1.6 MiB).
    assert not {"typing", "enum", "shutil", "tempfile", "argparse"} & master_modules
    outside = {name for name in master_modules if name.split(".")[0] not in sys.stdlib_module_names}
    assert not outside, f"the master imported {sorted(outside)}"
    worker_modules = set(IMPORT_LINE.findall(worker_own))
    assert {"pynvml", "prometheus_client", "kepler_bridge.sampling.sampler"} <= worker_modules
    assert {"kepler_bridge.http.app", "kepler_bridge.http.dispatch", "gunicorn"} <= worker_modules
    everywhere = set(IMPORT_LINE.findall(agent.output()))
    assert not _under(everywhere, NOWHERE)
    assert str(fake_nvml.library) in worker_maps
    for library in (str(fake_nvml.library), *NOT_MAPPED_IN_MASTER):
        assert library not in master_maps, library
