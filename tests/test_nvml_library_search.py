"""--nvml-library DIR: the agent finds libnvidia-ml.so.1 in the driver layouts of amd64, arm64 and
Jetson hosts (the privileged manifests mount the host's /usr and name it), through the real CLI and
the fake NVML library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import KEPLER_BRIDGE
from fakenvml import FakeNvml

pytestmark = pytest.mark.e2e


def _collect(fake_nvml: FakeNvml, library: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **fake_nvml.env(), "KUBE_NODE_NAME": "edge-1"}
    return subprocess.run(
        [KEPLER_BRIDGE, "collect", "--json", "--sources", "nvml", "--nvml-library", str(library)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _install(fake_nvml: FakeNvml, usr: Path, layout: str) -> None:
    (usr / layout).mkdir(parents=True, exist_ok=True)
    shutil.copy(fake_nvml.library, usr / layout / "libnvidia-ml.so.1")


@pytest.mark.parametrize(
    "layout", ["lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu/tegra", "lib64", "local/nvidia/lib64"]
)
def test_the_library_is_found_under_a_usr_tree(
    fake_nvml: FakeNvml, tmp_path: Path, layout: str
) -> None:
    _install(fake_nvml, tmp_path / "usr", layout)
    result = _collect(fake_nvml, tmp_path / "usr")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["edge-1"]["deviceNum"] == 2


def test_a_library_that_does_not_load_here_is_skipped(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    # Searched first, like another architecture's library on a multiarch host: dlopen refuses it.
    foreign = tmp_path / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"\x7fELF not a library for this machine")
    _install(fake_nvml, tmp_path / "usr", "lib/aarch64-linux-gnu")
    result = _collect(fake_nvml, tmp_path / "usr")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["edge-1"]["deviceNum"] == 2


def test_no_loadable_library_is_reported_with_what_was_tried(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    foreign = tmp_path / "usr" / "lib64" / "libnvidia-ml.so.1"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"not a library")
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--sources", "nvml", "--nvml-library", str(tmp_path / "usr")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = [line for line in doctor.stdout.splitlines() if line.split()[1:2] == ["nvml"]]
    assert line.startswith("no") and "can be loaded" in line and str(foreign) in line, line


def test_a_tree_without_the_library_says_where_it_looked(tmp_path: Path) -> None:
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--sources", "nvml", "--nvml-library", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = [line for line in doctor.stdout.splitlines() if line.split()[1:2] == ["nvml"]]
    assert line.startswith("no") and f"no libnvidia-ml.so.1 in {tmp_path}" in line
    assert "lib/aarch64-linux-gnu/tegra" in line, line
