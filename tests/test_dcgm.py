"""--metric-names dcgm: dcgm-exporter's names, units and labels for the same snapshot."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families

import scaffold
from kepler_bridge.exposition import RENDERERS, RenderSettings, dcgm
from kepler_bridge.exposition.catalogue import HEALTH
from kepler_bridge.model import (
    Energy,
    GpuReading,
    Holder,
    MigInstance,
    NvLink,
    PodRef,
    Snapshot,
    SourceStatus,
)

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


MIB = 2**20
RELIABILITY: dict[str, object] = dict(
    memory_reserved_bytes=512 * MIB + 1,
    pcie_replays=3,
    clock_event_seconds=(
        ("power", 1.5),
        ("thermal", 2e-9),
        ("sync_boost", 0.0),
        ("board_limit", 2.0),
        ("low_utilization", 10.25),
        ("reliability", 0.0),
    ),
    retired_pages_single_bit=2,
    retired_pages_double_bit=1,
    retired_pages_pending=True,
    remapped_rows_correctable=5,
    remapped_rows_uncorrectable=1,
    row_remap_failed=False,
    row_remap_pending=True,
    nvlinks=(
        NvLink(0, True, 10, 20, (("crc_flit", 1), ("crc_data", 2), ("replay", 3), ("recovery", 0))),
        NvLink(1, True, 5, 5, (("crc_flit", 10), ("replay", 4))),
        NvLink(2, False),
    ),
)
PROFILED: dict[str, object] = dict(
    graphics_active=0.9,
    sm_active=0.8,
    sm_occupancy=0.5,
    tensor_active=0.25,
    dram_active=0.625,
    pipe_active=(
        ("tensor_hmma", 0.25),
        ("tensor_imma", 0.0),
        ("tensor_dfma", 0.05),
        ("fp64", 0.1),
        ("fp32", 0.2),
        ("fp16", 0.3),
        ("integer", 0.15),
    ),
    profiled_pcie_transmit_bytes_per_second=1.5e9 + 0.4,  # DCGM's bytes per second are whole
    profiled_pcie_receive_bytes_per_second=2e8,
    profiled_nvlink_transmit_bytes_per_second=300.0 * MIB,
    profiled_nvlink_receive_bytes_per_second=100.25 * MIB,
    engine_active=(("nvdec", 0.5), ("nvjpg", 0.0), ("nvofa", 0.125)),
)


def h100(index: int = 0, **values: object) -> GpuReading:
    """A GPU that reports every field: GPM profiling, NVLinks and the reliability counters."""
    return dataclasses.replace(
        a100(index, **{**RELIABILITY, **PROFILED, **values}), model="NVIDIA H100 80GB HBM3"
    )


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
    found = scrape(snapshot(h100()))
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
        "DCGM_FI_DEV_FB_RESERVED": 512,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 3,
        "DCGM_FI_DEV_POWER_VIOLATION": 1_500_000_000,  # ns
        "DCGM_FI_DEV_THERMAL_VIOLATION": 2,
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION": 0,
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION": 2_000_000_000,
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION": 10_250_000_000,
        "DCGM_FI_DEV_RELIABILITY_VIOLATION": 0,
        "DCGM_FI_DEV_RETIRED_SBE": 2,
        "DCGM_FI_DEV_RETIRED_DBE": 1,
        "DCGM_FI_DEV_RETIRED_PENDING": 1,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 5,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
        "DCGM_FI_DEV_ROW_REMAP_PENDING": 1,
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 11,  # summed over the links
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": 2,
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 7,
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": 0,
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 400,  # MiB/s, transmit and receive
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.9,  # ratios as DCGM gives them, 0 to 1
        "DCGM_FI_PROF_SM_ACTIVE": 0.8,
        "DCGM_FI_PROF_SM_OCCUPANCY": 0.5,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.25,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.625,
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE": 0.1,
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE": 0.2,
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE": 0.3,
        "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE": 0.25,
        "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE": 0.0,
        "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE": 0.05,
        "DCGM_FI_PROF_PIPE_INT_ACTIVE": 0.15,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 1_500_000_000,
        "DCGM_FI_PROF_PCIE_RX_BYTES": 200_000_000,
        "DCGM_FI_PROF_NVLINK_TX_BYTES": 300 * MIB,
        "DCGM_FI_PROF_NVLINK_RX_BYTES": 100.25 * MIB,
    }
    assert {name: value(found, name) for name in expected} == expected
    assert {field.name for field in dcgm.FIELDS} == set(expected)


def test_labels_are_dcgm_exporters() -> None:
    found = scrape(snapshot(h100(3)))
    dcgm_samples = [
        s for name, samples in found.items() if name.startswith("DCGM_") for s in samples
    ]
    assert len(dcgm_samples) == len(dcgm.FIELDS)
    assert all(s.labels == dcgm_samples[0].labels for s in dcgm_samples)
    assert dcgm_samples[0].labels == {
        "gpu": "3",
        "UUID": "GPU-3",
        "pci_bus_id": "00000000:17:00.0",
        "device": "nvidia3",
        "modelName": "NVIDIA H100 80GB HBM3",
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


def test_a_gpu_without_gpm_nvlinks_or_remapping_has_none_of_their_series() -> None:
    found = scrape(snapshot(a100()))
    profiling = {name for name in found if name.startswith("DCGM_FI_PROF_")}
    assert not profiling
    absent = {
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_POWER_VIOLATION",
        "DCGM_FI_DEV_RETIRED_SBE",
        "DCGM_FI_DEV_RETIRED_PENDING",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    }
    assert not absent & set(found)


def test_a_field_is_absent_where_its_part_of_the_reading_is() -> None:
    partial = h100(
        pipe_active=(("fp32", 0.5),),
        clock_event_seconds=(("power", 1.0),),
        nvlinks=(NvLink(0, True, 1, 1, (("replay", 2),)), NvLink(1, False)),
        profiled_nvlink_receive_bytes_per_second=None,  # a total needs both directions
    )
    found = scrape(snapshot(partial))
    assert value(found, "DCGM_FI_PROF_PIPE_FP32_ACTIVE") == 0.5
    assert "DCGM_FI_PROF_PIPE_FP64_ACTIVE" not in found
    assert value(found, "DCGM_FI_DEV_POWER_VIOLATION") == 1e9
    assert "DCGM_FI_DEV_THERMAL_VIOLATION" not in found
    assert value(found, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL") == 2
    assert "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL" not in found
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in found
    assert value(found, "DCGM_FI_PROF_NVLINK_TX_BYTES") == 300 * MIB


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
    text = RENDERERS["openmetrics"](snapshot(h100()), DCGM).decode()
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


def test_mig_gpu_instances_get_series_labelled_gpu_i_id_and_gpu_i_profile() -> None:
    infer = PodRef("ml", "infer-0", "server")
    instances = (
        MigInstance(
            1, 0, "MIG-a", "3g.40gb", 3, 2**30 + 2**19, 40 * 2**30, holders=(Holder("c1", OWNER),)
        ),
        MigInstance(1, 1, "MIG-b", "3g.40gb", 3, holders=(Holder("c1", OWNER),)),
        MigInstance(
            2,
            0,
            "MIG-c",
            "1g.10gb",
            1,
            0,
            10 * 2**30,
            sm_active=0.5,
            sm_occupancy=0.25,
            graphics_active=0.75,
            tensor_active=0.125,
            dram_active=0.0,
            holders=(Holder("c2", infer),),
        ),
    )
    mig = a100(0, utilization=None, mig_instances=instances, holders=())
    found = scrape(snapshot(mig))

    def per_instance(name: str) -> dict[tuple[str, str], float]:
        return {
            (s.labels.get("GPU_I_ID", ""), s.labels.get("GPU_I_PROFILE", "")): s.value
            for s in found[name]
        }

    # The parent's series as without MIG (no GPU_I_* labels), one more per GPU instance.
    assert per_instance("DCGM_FI_DEV_FB_USED") == {
        ("", ""): 40960,
        ("1", "3g.40gb"): 1024,
        ("2", "1g.10gb"): 0,
    }
    assert per_instance("DCGM_FI_DEV_FB_FREE")[("1", "3g.40gb")] == 39 * 1024 - 1
    assert per_instance("DCGM_FI_DEV_FB_TOTAL")[("2", "1g.10gb")] == 10 * 1024
    assert per_instance("DCGM_FI_PROF_SM_ACTIVE") == {("2", "1g.10gb"): 0.5}
    assert per_instance("DCGM_FI_PROF_SM_OCCUPANCY") == {("2", "1g.10gb"): 0.25}
    assert per_instance("DCGM_FI_PROF_GR_ENGINE_ACTIVE") == {("2", "1g.10gb"): 0.75}
    assert per_instance("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") == {("2", "1g.10gb"): 0.125}
    assert per_instance("DCGM_FI_PROF_DRAM_ACTIVE") == {("2", "1g.10gb"): 0.0}
    assert "DCGM_FI_DEV_GPU_UTIL" not in found  # not on a MIG parent: absent
    (gi1,) = [s for s in found["DCGM_FI_DEV_FB_USED"] if s.labels.get("GPU_I_ID") == "1"]
    assert gi1.labels == {
        "gpu": "0",
        "UUID": "GPU-0",
        "pci_bus_id": "00000000:17:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "Hostname": "n1",
        "DCGM_FI_DRIVER_VERSION": "550.54.15",
        "GPU_I_PROFILE": "3g.40gb",
        "GPU_I_ID": "1",
        "namespace": "ml",
        "pod": "train-0",
        "container": "main",
    }
    pods = {s.labels.get("GPU_I_ID"): s.labels.get("pod") for s in found["DCGM_FI_DEV_FB_TOTAL"]}
    assert pods == {None: None, "1": "train-0", "2": "infer-0"}
