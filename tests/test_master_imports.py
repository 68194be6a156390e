"""What each process of a running agent has loaded (issue 18): the gunicorn master holds gunicorn
and the settings, the worker what its sources and features use.

Seen from outside the agent: with PYTHONPROFILEIMPORTTIME set, the `import time:` lines before the
worker's "Booting worker" line are the master's imports before the fork, the lines after it the
modules the worker imported itself; /proc/PID/maps shows the shared libraries of each.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml

pytestmark = pytest.mark.e2e

# The master binds, forks and restarts the worker: no driver binding, renderer or route.
NOT_IN_MASTER = (
    "pynvml",
    "grpc",
    "bcc",
    "prometheus_client",
    "flask",
    "yaml",
    "kepler_bridge.sampling.sampler",
    "kepler_bridge.sources.nvml",
    "kepler_bridge.kube",
    "kepler_bridge.exposition",
    "kepler_bridge.http.app",
)
# Neither process needs these here: no web framework, no config file, no pod-resources.
NOWHERE = ("flask", "werkzeug", "jinja2", "yaml", "grpc", "google.protobuf")
# The shared libraries of grpc, bcc and PyYAML.
NOT_MAPPED_IN_MASTER = ("cygrpc", "libbcc", "_yaml")
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", re.MULTILINE)


def _under(names: set[str], packages: tuple[str, ...]) -> set[str]:
    return {name for name in names for package in packages if f"{name}.".startswith(f"{package}.")}


def test_the_master_holds_gunicorn_and_the_settings_only(fake_nvml: FakeNvml) -> None:
    args = ("--sources", "nvml", "--nvml-library", str(fake_nvml.library), "--interval", "0.25s")
    with Agent(*args, env={**fake_nvml.env(), "PYTHONPROFILEIMPORTTIME": "1"}) as agent:
        assert agent.process is not None
        (worker,) = agent.worker_pids()
        master_maps = Path(f"/proc/{agent.process.pid}/maps").read_text()
        worker_maps = Path(f"/proc/{worker}/maps").read_text()
        before, booting, after = agent.output().partition("Booting worker with pid")
    assert booting, "no worker booted"
    master, worker_own = set(IMPORT_LINE.findall(before)), set(IMPORT_LINE.findall(after))
    assert {"gunicorn.arbiter", "kepler_bridge.config", "kepler_bridge.http.server"} <= master
    assert not _under(master, NOT_IN_MASTER)
    # The worker imported them after the fork: the test sees what it looks for.
    assert {"pynvml", "prometheus_client", "kepler_bridge.sampling.sampler"} <= worker_own
    assert {"kepler_bridge.http.app", "kepler_bridge.http.dispatch"} <= worker_own
    assert not _under(master | worker_own, NOWHERE)
    assert str(fake_nvml.library) in worker_maps
    for library in (str(fake_nvml.library), *NOT_MAPPED_IN_MASTER):
        assert library not in master_maps, library
