"""Plug-in sources: packages with an entry point in group kepler_bridge.sources are found like
built-ins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent import KEPLER_BRIDGE, Agent
from scaffold import values

EXAMPLE = Path(__file__).parent.parent / "examples" / "rknpu-plugin"
FAKE_PLUGINS = {
    "kb_fake_plugins.py": """
from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources.base import Source, SourceAbsent

class Explicit(Source):
    name = "explicit"
    def start(self):
        pass
    def read(self):
        gpu = GpuReading(index=0, uuid="X-0", vendor="acme", model="Explicit")
        return SourceReading(gpus=(gpu,))

class Imposter(Explicit):
    name = "nvml"

class Raising(Explicit):
    name = "raising"
    auto = True
    def __init__(self, config):
        raise OSError(19, "No such device", "/dev/rknpu")

not_a_class = 42
""",
    "kb_broken_plugin.py": "import kb_dependency_that_is_not_installed\n",
}
FAKE_ENTRY_POINTS = {
    "explicit": "kb_fake_plugins:Explicit",
    "nvml": "kb_fake_plugins:Imposter",
    "notsource": "kb_fake_plugins:not_a_class",
    "broken": "kb_broken_plugin:Source",
    "raising": "kb_fake_plugins:Raising",
}


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plug-in package, installed by pip into a directory of its own
    (put on PYTHONPATH)."""
    work = tmp_path_factory.mktemp("example-plugin")
    # Built from a copy: a build writes build/ and *.egg-info next to the sources.
    shutil.copytree(
        EXAMPLE, work / "src", ignore=shutil.ignore_patterns("__pycache__", "tests", "conftest.py")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(work / "site"),
            str(work / "src"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return work / "site"


@pytest.fixture
def fake_site(tmp_path: Path) -> Path:
    """A distribution made by hand: its metadata, its entry points and its modules."""
    site = tmp_path / "fake-site"
    info = site / "kb_fake_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kb-fake-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kepler_bridge.sources]\n"
        + "".join(f"{name} = {value}\n" for name, value in FAKE_ENTRY_POINTS.items())
    )
    for name, text in FAKE_PLUGINS.items():
        (site / name).write_text(text)
    return site


def rk3588(root: Path) -> Path:
    """The sysfs files the example plug-in reads on an RK3588 board."""
    (root / "class" / "devfreq" / "fdab0000.npu").mkdir(parents=True)
    (root / "class" / "devfreq" / "fdab0000.npu" / "cur_freq").write_text("1000000000\n")
    (root / "kernel" / "debug" / "rknpu").mkdir(parents=True)
    (root / "kernel" / "debug" / "rknpu" / "load").write_text(
        "NPU load:  Core0: 30%, Core1: 60%, Core2:  0%,\n"
    )
    return root


def env(*sites: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(map(str, sites))}


def python(code: str, *sites: Path) -> str:
    """Run code in a fresh interpreter that sees these sites; its stdout and stderr."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env(*sites)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def source_up(agent: Agent) -> dict[str, float]:
    return values(agent.metrics(), "kepler_bridge_source_up", "source")


@pytest.mark.e2e
def test_an_installed_plugin_serves_like_a_builtin(example_site: Path, tmp_path: Path) -> None:
    sysfs = rk3588(tmp_path / "sys")
    with Agent(
        "--sources", "rknpu", "--sysfs", str(sysfs), "--interval", "0.25s", env=env(example_site)
    ) as agent:
        assert agent.samples("gpu_utilization_ratio") == {"0": pytest.approx(0.3)}
        assert agent.samples("gpu_sm_clock_hertz") == {"0": 1e9}
        assert 'uuid="ROCKCHIP-fdab0000.npu",vendor="rockchip"' in agent.metrics()
        assert agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 1
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", "--sources", "rknpu", "--sysfs", str(sysfs)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env(example_site)},
    )
    assert any(
        line.split()[:2] == ["ok", "rknpu"] and "rockchip Rockchip NPU" in line
        for line in doctor.stdout.splitlines()
    ), doctor.stdout


def test_auto_takes_the_plugins_that_ask_for_it_after_the_builtins(
    example_site: Path, fake_site: Path
) -> None:
    groups = python(
        "from kepler_bridge.config import load\n"
        "from kepler_bridge.sources import AUTO, selected_groups\n"
        "groups = selected_groups(load({}, {}))\n"
        "print(groups[:len(AUTO)] == list(AUTO), groups[len(AUTO):])",
        example_site,
        fake_site,
    )
    # rknpu and raising say auto = True, explicit does not; the broken ones cannot say, and are
    # shown (down), not hidden.
    assert "True [('rknpu',), ('notsource',), ('broken',), ('raising',)]" in groups
    assert groups.count("ignored: a built-in source has that name") == 1


@pytest.mark.e2e
def test_unknown_source_names_the_plugins(example_site: Path) -> None:
    result = subprocess.run(
        [KEPLER_BRIDGE, "serve", "--sources", "rknpux"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env(example_site)},
    )
    assert (
        result.returncode == 2
        and "unknown source 'rknpux'" in result.stderr
        and "rknpu," in result.stderr
    )


def test_a_plugin_cannot_replace_a_builtin(fake_site: Path) -> None:
    out = python(
        "from kepler_bridge.sources import available, source_class\n"
        "print(available()['nvml'], source_class('nvml').__name__, "
        "source_class('explicit').__name__)",
        fake_site,
    )
    assert "kepler_bridge.sources.nvml.source:NvmlSource NvmlSource Explicit" in out
    assert (
        "plug-in source 'nvml' (kb_fake_plugins:Imposter) ignored: a built-in source has that name"
        in out
    )


@pytest.mark.e2e
def test_a_broken_plugin_is_a_down_source_with_its_reason(fake_site: Path) -> None:
    with Agent(
        "--sources", "broken,notsource,raising,explicit", "--interval", "0.25s", env=env(fake_site)
    ) as agent:
        assert source_up(agent) == {
            "broken": 0.0,
            "notsource": 0.0,
            "raising": 0.0,
            "explicit": 1.0,
        }
        assert agent.samples("gpu_up") == {"0": 1.0}
        page = agent.get("/").text
    assert (
        "source broken (kb_broken_plugin:Source) cannot be loaded: ModuleNotFoundError: "
        "No module named &#x27;kb_dependency_that_is_not_installed&#x27;; "
        "reinstall or fix the package that provides it"
    ) in page
    assert "cannot be loaded: it is not a subclass of kepler_bridge.sources.base.Source" in page
    assert (
        "source raising (kb_fake_plugins:Raising) cannot be made: OSError: [Errno 19] No such "
        "device: &#x27;/dev/rknpu&#x27;"
    ) in page
    # With --sources auto (the default) it is taken too: every command runs on without it.
    for command in (["collect", "--prometheus"], ["doctor"]):
        run = subprocess.run(
            [KEPLER_BRIDGE, *command, "--simulate", "1", "--node-name", "n1"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env(fake_site)},
        )
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        assert "cannot be made" in run.stdout + run.stderr
