"""--metric-names dcgm: dcgm-exporter's names, units and labels for the same snapshot."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families

import scaffold
from kepler_bridge.exposition import RENDERERS, RenderSettings, dcgm
from kepler_bridge.exposition.catalogue import HEALTH
from kepler_bridge.model import Energy, GpuReading, Holder, PodRef, Snapshot, SourceStatus

DCGM = RenderSettings((), (), "bytes", "dcgm")
OURS = RenderSettings((), (), "bytes")
OWNER = PodRef("ml", "train-0", "main")


def a100(index: int = 0, **values: object) -> GpuReading:
    """An NVIDIA GPU as the nvml source reads it: the values in our units."""
    readings: dict[str, object] = dict(
        driver_version="550.54.15",
        pci_bus_id="00000000:17:00.0",
        utilization=0.97,
        memory_utilization=0.43,
        encoder_utilization=0.0,
        decoder_utilization=0.05,
        memory_used_bytes=40 * 2**30 + 2**19,  # 40960.5 MiB: DCGM's MiB are whole
        memory_free_bytes=39 * 2**30,
        memory_total_bytes=80 * 2**30,
        temperature_celsius=61.0,
        memory_temperature_celsius=70.0,
        power_watts=312.25,
        power_limit_watts=400.0,
        energy_joules=123456.789,
        sm_clock_hertz=1410e6,
        memory_clock_hertz=1593e6,
        fan_speed_ratio=0.3,
        pcie_transmit_bytes_per_second=2048.0 * 1024,
        pcie_receive_bytes_per_second=512.0 * 1024,
        performance_state=0,
        ecc_corrected_total=4,
        ecc_uncorrected_total=1,
        xid_errors=((79, 2),),
        last_xid_code=79,
    )
    readings.update(values)
    model = "NVIDIA A100-SXM4-80GB"
    return GpuReading(index, f"GPU-{index}", "nvidia", model, **readings)  # type: ignore[arg-type]


def snapshot(*gpus: GpuReading) -> Snapshot:
    return Snapshot(
        node="n1",
        timestamp=1.0,
        duration_seconds=0.01,
        interval_seconds=1.0,
        sources=(SourceStatus("nvml", True),),
        gpus=gpus,
        energy=Energy(gpu_idle=(("GPU-0", 5.0),)),
    )


def scrape(snap: Snapshot, settings: RenderSettings = DCGM) -> dict[str, list]:
    text = RENDERERS["text"](snap, settings).decode()
    return {name: family.samples for name, family in scaffold.families(text).items()}


def value(found: dict[str, list], name: str, gpu: str = "0") -> float:
    (sample,) = [s for s in found[name] if s.labels["gpu"] == gpu]
    return sample.value


def test_values_are_in_dcgm_units() -> None:
    found = scrape(snapshot(a100()))
    expected = {
        "DCGM_FI_DEV_GPU_UTIL": 97,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 43,
        "DCGM_FI_DEV_ENC_UTIL": 0,
        "DCGM_FI_DEV_DEC_UTIL": 5,
        "DCGM_FI_DEV_FB_USED": 40960,
        "DCGM_FI_DEV_FB_FREE": 39936,
        "DCGM_FI_DEV_FB_TOTAL": 81920,
        "DCGM_FI_DEV_GPU_TEMP": 61,
        "DCGM_FI_DEV_MEMORY_TEMP": 70,
        "DCGM_FI_DEV_POWER_USAGE": 312.25,
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 400,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 123456789,
        "DCGM_FI_DEV_SM_CLOCK": 1410,
        "DCGM_FI_DEV_MEM_CLOCK": 1593,
        "DCGM_FI_DEV_FAN_SPEED": 30,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 2048,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": 512,
        "DCGM_FI_DEV_PSTATE": 0,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 4,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1,
        "DCGM_FI_DEV_XID_ERRORS": 79,
    }
    assert {name: value(found, name) for name in expected} == expected
    assert {field.name for field in dcgm.FIELDS} == set(expected)


def test_labels_are_dcgm_exporters() -> None:
    found = scrape(snapshot(a100(3)))
    (sample,) = found["DCGM_FI_DEV_GPU_UTIL"]
    assert sample.labels == {
        "gpu": "3",
        "UUID": "GPU-3",
        "pci_bus_id": "00000000:17:00.0",
        "device": "nvidia3",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "Hostname": "n1",
        "DCGM_FI_DRIVER_VERSION": "550.54.15",
    }


def test_the_pod_the_kubelet_assigned_the_gpu_to_labels_its_series() -> None:
    held = a100(0, holders=(Holder("c1", OWNER),))
    shared = a100(1, holders=(Holder("c1", OWNER), Holder("c2", PodRef("ml", "train-1", "main"))))
    found = scrape(snapshot(held, a100(2), shared))
    pods = {
        s.labels["gpu"]: (s.labels.get("namespace"), s.labels.get("pod"), s.labels.get("container"))
        for s in found["DCGM_FI_DEV_FB_USED"]
    }
    assert pods == {
        "0": ("ml", "train-0", "main"),
        "1": (None, None, None),
        "2": (None, None, None),
    }


def test_unreported_values_and_lost_gpus_have_no_series() -> None:
    found = scrape(snapshot(a100(0, fan_speed_ratio=None), a100(1, up=False)))
    assert "DCGM_FI_DEV_FAN_SPEED" not in found
    assert {s.labels["gpu"] for s in found["DCGM_FI_DEV_GPU_UTIL"]} == {"0"}
    assert {s.labels["gpu"]: s.value for s in found["gpu_up"]} == {"0": 1.0, "1": 0.0}


def test_xid_errors_is_the_last_code_whatever_the_counts() -> None:
    several = a100(0, xid_errors=((48, 1), (79, 3)), last_xid_code=48)
    found = scrape(snapshot(several, a100(1, xid_errors=(), last_xid_code=None)))
    assert {s.labels["gpu"]: s.value for s in found["DCGM_FI_DEV_XID_ERRORS"]} == {"0": 48}


def test_gpu_families_give_way_and_the_agents_own_series_stay() -> None:
    snap = snapshot(a100())
    ours, theirs = set(scrape(snap, OURS)), set(scrape(snap))
    assert not {name for name in theirs if name.startswith("gpu_")} - {"gpu_up"}
    assert {name for name in ours if not name.startswith("gpu_")} <= theirs
    assert HEALTH <= theirs | {"kepler_bridge_ebpf_programs_attached"}
    assert "kepler_bridge_node_gpu_idle_joules" in theirs  # the parser drops _total


def test_allow_list_applies_to_dcgm_names_and_health_stays() -> None:
    allowed = dataclasses.replace(DCGM, metrics_allow=("DCGM_FI_DEV_FB_",))
    found = set(scrape(snapshot(a100()), allowed))
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_TOTAL"} <= found
    assert "DCGM_FI_DEV_GPU_UTIL" not in found
    assert "gpu_up" in found


def test_openmetrics_is_valid_and_counters_are_untyped() -> None:
    text = RENDERERS["openmetrics"](snapshot(a100()), DCGM).decode()
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == "unknown"
    assert types["DCGM_FI_DEV_GPU_UTIL"] == "gauge"
    kinds = {field.name: field.kind for field in dcgm.FIELDS}
    assert {name for name, kind in kinds.items() if kind == "counter"} == {
        name for name, kind in types.items() if name.startswith("DCGM_") and kind == "unknown"
    }


def test_default_names_are_ours() -> None:
    snap = snapshot(a100())
    # process_* are the agent's own CPU and memory, read anew by each render: left out.
    settings = (
        RenderSettings((), ("process_",), "bytes"),
        RenderSettings((), ("process_",), "bytes", "kepler"),
    )
    assert RENDERERS["text"](snap, settings[0]) == RENDERERS["text"](snap, settings[1])
    assert not any(name.startswith("DCGM_") for name in scrape(snap, OURS))
    assert scaffold.make_config().metric_names == "kepler"
    assert RenderSettings.of(scaffold.make_config(metric_names="dcgm")) == DCGM


def test_design_lists_exactly_the_fields() -> None:
    design = (Path(__file__).parent.parent / "docs" / "design.md").read_text(encoding="utf-8")
    text = design.split("\n## dcgm-exporter names\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(DCGM_FI_[A-Z0-9_]+)` \|", text, re.MULTILINE)
    assert listed == [field.name for field in dcgm.FIELDS]
