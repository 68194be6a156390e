"""scripts/gpu-check.sh against the fake NVML and a fake nvidia-smi (tests/fake_nvidia_smi.py)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakenvml import FakeNvml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
BASH = shutil.which("bash") or "/bin/bash"
sys.path.insert(0, str(ROOT / "scripts"))
fields = importlib.import_module("gpu_check_fields")
check = importlib.import_module("gpu_check")


def _row(output: str, series: str) -> list[str]:
    """The cells of the first table row of `series` (cells are split on two spaces)."""
    for line in output.splitlines():
        if line.startswith(series + "  "):
            return [cell.strip() for cell in line.split("  ") if cell.strip()]
    raise AssertionError(f"no row {series!r} in:\n{output}")


def _environment(fake: FakeNvml, tmp_path: Path, **extra: str) -> dict[str, str]:
    """nvidia-smi is the fake, first on PATH; kepler-bridge loads the fake NVML library."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests/fake_nvidia_smi.py"} "$@"\n')
    smi.chmod(0o755)
    return {
        **os.environ,
        **fake.env(),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "KEPLER_BRIDGE_NVML_LIBRARY": str(fake.library),
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": "",
        **extra,
    }


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.e2e
def test_equal_values_agree_in_collect_and_serve(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    env = _environment(fake_nvml, tmp_path)
    process = subprocess.Popen(
        [BASH, str(SCRIPT), "--serve-seconds", "4", "--scrapes", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    start = time.monotonic()
    while process.poll() is None:  # both GPUs draw 250 W: their energy counters follow
        joules = 250 * (time.monotonic() - start)
        for index in (0, 1):
            fake_nvml.gpu(index, total_energy=int(1e9 + index * 1e6 + joules * 1000))
        time.sleep(0.1)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, out + err
    assert "read-only" in out and "2 GPU(s), 0 row(s) disagree" in out
    for series in ("gpu_utilization_ratio", "gpu_memory_used_bytes", "gpu_power_watts"):
        cells = _row(out, series)
        assert cells[-3:] == ["yes", "both", "2/2"], cells
    assert _row(out, "gpu_performance_state")[2:4] == ["0", "0"]
    assert _row(out, "rate(gpu_energy_joules_total)")[4] == "yes"
    assert "gpu_sm_active_ratio" in out and "gpu_nvlink_up" in out


@pytest.mark.e2e
def test_a_different_value_disagrees(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.gpu(0, not_supported=["fan_speed"])
    env = _environment(
        fake_nvml,
        tmp_path,
        FAKE_SMI_OVERRIDE="temperature.gpu=75",
        FAKE_SMI_REMAPPED_ROWS="0,0,0,0",
    )
    done = _run(env, "--serve-seconds", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    temperature = _row(done.stdout, "gpu_temperature_celsius")
    assert temperature[1:5] == ["temperature.gpu", "60", "75", "NO"], temperature
    assert _row(done.stdout, "gpu_memory_total_bytes")[4] == "yes"
    # Unsupported on both sides: absent from our output, [N/A] in nvidia-smi's.
    assert _row(done.stdout, "gpu_fan_speed_ratio")[2:6] == ["-", "-", "yes", "neither"]
    assert "DISAGREE" in done.stdout
    remapped = _row(done.stdout, 'gpu_remapped_rows_total{cause="correctable"}')
    assert remapped[1] == "remapped_rows.correctable" and remapped[3] == "0", remapped


def test_a_machine_without_nvidia_smi_is_told_so(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "PYTHON": sys.executable}
    done = _run(env)
    assert done.returncode == 2 and done.stdout == ""
    assert "no nvidia-smi on PATH" in done.stderr and "nothing was checked" in done.stderr


def test_nvidia_smi_without_a_driver_is_told_so(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    env = _environment(fake_nvml, tmp_path)
    del env["FAKE_NVML_CONFIG"]
    done = _run(env)
    assert done.returncode == 2
    assert "nvidia-smi lists no GPU here" in done.stderr
    assert "couldn't communicate with the NVIDIA driver" in done.stderr


def test_missing_dependencies_name_the_bundle(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    bare = tmp_path / "bare"  # a Python with the standard library alone
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    env = _environment(fake_nvml, tmp_path, PYTHON=str(bare / "bin" / "python"))
    env.pop("PYTHONPATH", None)
    done = _run(env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "kepler-bridge cannot run with" in done.stderr
    assert "make gpu-check-bundle" in done.stderr


def test_nvidia_smi_is_only_asked_queries() -> None:
    for setting in (["-pm", "1"], ["-pl", "300"], ["-mig", "0"], ["-rgc"], ["-ac", "1593,1410"]):
        with pytest.raises(ValueError, match="read-only"):
            check.smi(*setting)


@pytest.mark.parametrize(
    "mine, before, after, agree, supported",
    [
        (50.0, 40.0, 60.0, True, "both"),
        (75.0, 40.0, 60.0, False, "both"),
        (65.0, 60.0, None, True, "both"),  # within the 10 points of tolerance
        (None, None, None, True, "neither"),
        (50.0, None, None, False, "ours only"),
        (None, 50.0, 50.0, False, "nvidia-smi only"),
    ],
)
def test_compare_brackets_ours_by_the_two_reads(
    mine: float | None, before: float | None, after: float | None, agree: bool, supported: str
) -> None:
    utilization = next(f for f in fields.FIELDS if f.metric == "gpu_utilization_ratio")
    verdict = fields.compare(utilization, mine, before, after)
    assert (verdict.agree, verdict.supported) == (agree, supported)


def test_nvidia_smi_values_are_read_in_its_units() -> None:
    by_metric = {(f.metric, f.selector): f for f in fields.FIELDS}
    pstate = by_metric[("gpu_performance_state", ())]
    throttled = by_metric[("gpu_throttled", ())]
    assert fields.smi_value(pstate, "P8") == 8
    assert fields.smi_value(throttled, "0x0000000000000005") == 5
    assert fields.smi_value(pstate, "[N/A]") is None
    assert fields.smi_value(by_metric[("gpu_row_remap_pending", ())], "No") == 0


@pytest.mark.parametrize(
    "wheel, fits",
    [
        ("flask-3.1.3-py3-none-any.whl", True),
        ("bcrypt-5.0.0-cp39-abi3-manylinux_2_28_x86_64.whl", True),
        ("bcrypt-5.0.0-cp39-abi3-manylinux_2_28_aarch64.whl", False),
        ("PyYAML-6.0.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("PyYAML-6.0.3-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", False),
    ],
)
def test_the_bundle_unpacks_only_wheels_for_this_python(wheel: str, fits: bool) -> None:
    assert check.wheel_fits(wheel, (3, 12), "x86_64") is fits
