"""Snapshot to bytes: omitted readings, filters, the baetyl contract, monotonic counters."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import scaffold
from kepler_bridge.exposition import baetyl, dcgm, prometheus
from kepler_bridge.model import (
    ContainerCpu,
    CpuZoneEnergy,
    Energy,
    GpuProcess,
    GpuReading,
    Holder,
    NvLink,
    PodRef,
    ProcessCpu,
    Snapshot,
    SourceStatus,
    WorkloadEnergy,
)
from kepler_bridge.sampling.counters import MonotonicCounters

GIB = 1024**3


def snapshot(*gpus: GpuReading) -> Snapshot:
    return Snapshot(
        node="n1",
        timestamp=1.0,
        duration_seconds=0.01,
        interval_seconds=1.0,
        sources=(SourceStatus("nvml", True),),
        gpus=gpus,
    )


def gpu(index: int, **values) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{index}", vendor="nvidia", model="A100", **values)


def families(snap: Snapshot, allowed=lambda name: True) -> dict[str, list]:
    text = prometheus.render(snap, allowed).decode()
    return {name: family.samples for name, family in scaffold.families(text).items()}


def test_unreported_values_are_omitted_not_sentinels() -> None:
    found = families(snapshot(gpu(0, utilization=0.5), gpu(1, power_watts=100.0)))
    assert [s.labels["gpu"] for s in found["gpu_utilization_ratio"]] == ["0"]
    assert [s.labels["gpu"] for s in found["gpu_power_watts"]] == ["1"]
    assert "gpu_fan_speed_ratio" not in found


def test_lost_gpu_has_up_0_and_info_only() -> None:
    found = families(snapshot(gpu(0, utilization=0.5), gpu(1, up=False, utilization=0.7)))
    assert {s.labels["gpu"]: s.value for s in found["gpu_up"]} == {"0": 1.0, "1": 0.0}
    assert [s.labels["gpu"] for s in found["gpu_utilization_ratio"]] == ["0"]
    assert len(found["gpu_info"]) == 2


def test_device_series_keep_their_labels_and_the_owner_is_a_series_of_its_own() -> None:
    gpus = (gpu(0, utilization=0.5, energy_joules=10.0), gpu(1, up=False))
    unowned = families(snapshot(*gpus))
    held = dataclasses.replace(gpus[0], holders=(Holder("", PodRef("ml", "train-0", "main")),))
    owned = families(snapshot(held, *gpus[1:]))
    assert set(owned) - set(unowned) == {"gpu_pod_info"}
    for name, samples in unowned.items():
        assert [sample.labels for sample in owned[name]] == [sample.labels for sample in samples], (
            name
        )
    device = {"node": "n1", "gpu": "0", "uuid": "GPU-0", "vendor": "nvidia", "model": "A100"}
    assert [(sample.labels, sample.value) for sample in owned["gpu_pod_info"]] == [
        (
            device
            | {"namespace": "ml", "pod": "train-0", "container": "main", "source": "pod-resources"},
            1.0,
        )
    ]


def test_labelled_families() -> None:
    snap = snapshot(
        gpu(
            0,
            throttled=(("hw_slowdown", True), ("gpu_idle", False)),
            ecc_uncorrected_total=2,
            xid_errors=((79, 1),),
            last_xid_timestamp=5.0,
            processes=(GpuProcess(pid=7, comm="python3", memory_used_bytes=GIB, utilization=0.25),),
        )
    )
    found = families(snap)
    assert {s.labels["reason"]: s.value for s in found["gpu_throttled"]} == {
        "hw_slowdown": 1,
        "gpu_idle": 0,
    }
    assert [(s.name, s.labels["kind"], s.value) for s in found["gpu_ecc_errors"]] == [
        ("gpu_ecc_errors_total", "uncorrected", 2)
    ]
    assert found["gpu_xid_errors"][0].labels["xid"] == "79"
    (proc,) = found["gpu_process_memory_used_bytes"]
    assert proc.labels | {} == {
        "node": "n1",
        "gpu": "0",
        "uuid": "GPU-0",
        "vendor": "nvidia",
        "model": "A100",
        "pid": "7",
        "comm": "python3",
        "namespace": "",
        "pod": "",
        "container": "",
    }
    assert found["gpu_process_utilization_ratio"][0].value == 0.25


def test_profiling_families_only_where_gpm_reported() -> None:
    snap = snapshot(
        gpu(
            0,
            sm_active=0.4,
            profiled_nvlink_receive_bytes_per_second=2e9,
            pipe_active=(("tensor_hmma", 0.3), ("fp32", 0.0)),
            engine_active=(("nvdec", 0.125),),
        ),
        gpu(1, utilization=0.5),
    )
    found = families(snap)
    assert [(s.labels["gpu"], s.value) for s in found["gpu_sm_active_ratio"]] == [("0", 0.4)]
    assert found["gpu_profiled_nvlink_receive_bytes_per_second"][0].value == 2e9
    assert {s.labels["pipe"]: s.value for s in found["gpu_pipe_active_ratio"]} == {
        "tensor_hmma": 0.3,
        "fp32": 0.0,
    }
    assert [(s.labels["engine"], s.value) for s in found["gpu_engine_active_ratio"]] == [
        ("nvdec", 0.125)
    ]
    assert "gpu_tensor_active_ratio" not in found and "gpu_sm_occupancy_ratio" not in found


HEALTH = {
    "gpu_up",
    "kepler_bridge_source_up",
    "kepler_bridge_source_state",
    "kepler_bridge_build_info",
    "kepler_bridge_last_sample_timestamp_seconds",
}


def test_filter_applies_to_exposed_names_including_seed_short_names() -> None:
    allowed = ("gpu_utilization", "gpu_memory_used", "gpu_temperature")
    found = families(
        snapshot(
            gpu(
                0,
                utilization=0.5,
                memory_used_bytes=5,
                memory_total_bytes=10,
                temperature_celsius=40.0,
            )
        ),
        lambda name: name.startswith(allowed),
    )
    assert (
        set(found)
        == {"gpu_utilization_ratio", "gpu_memory_used_bytes", "gpu_temperature_celsius"} | HEALTH
    )


def test_health_series_are_exported_whatever_the_lists_say() -> None:
    found = families(snapshot(gpu(0, utilization=0.5)), lambda name: False)
    assert set(found) == HEALTH
    assert [(s.labels["gpu"], s.value) for s in found["gpu_up"]] == [("0", 1.0)]


def test_every_emitted_family_is_declared() -> None:
    snap = Snapshot(
        node="n1",
        timestamp=1.0,
        duration_seconds=0.01,
        interval_seconds=1.0,
        sources=(SourceStatus("ebpf", True),),
        processes=(ProcessCpu(1, "init", 2.0, "abc"),),
        containers=(ContainerCpu("abc", 2.0),),
        ebpf_programs_attached=1,
        gpus=(
            gpu(
                0,
                utilization=0.1,
                energy_joules=1.0,
                ecc_corrected_total=0,
                throttled=(("gpu_idle", True),),
                xid_errors=((13, 1),),
            ),
        ),
    )
    text = prometheus.render(snap, lambda name: True).decode()
    names = {prometheus.exposed_name(f) for f in scaffold.families(text).values()}
    assert names - set(prometheus.METRICS) == {n for n in names if n.startswith("process_")}


def _names_assigned(statement: ast.stmt) -> set[str]:
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    else:
        targets = [getattr(statement, "target", None)]
    return {target.id for target in targets if isinstance(target, ast.Name)}


def test_every_metric_name_is_written_where_it_is_emitted() -> None:
    """A search for a metric's name finds the code that emits it.

    Each name is a literal string in exposition/ outside the METRICS and HEALTH tables."""
    literals: set[str] = set()
    for path in Path(prometheus.__file__).parent.glob("*.py"):
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            if not _names_assigned(statement) & {"METRICS", "HEALTH"}:
                literals |= {
                    node.value
                    for node in ast.walk(statement)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                }
    missing = sorted(set(prometheus.METRICS) - literals)
    assert not missing, f"write these names out where they are emitted, not built: {missing}"


def test_baetyl_contract_lost_device_keeps_place_and_no_nan() -> None:
    snap = snapshot(
        gpu(0, memory_used_bytes=100, memory_total_bytes=1000),
        gpu(1, up=False, memory_used_bytes=5, memory_total_bytes=10),
        gpu(2, memory_total_bytes=0),
    )
    body = json.loads(baetyl.render(snap))
    assert body == {
        "n1": {
            "deviceNum": 3,
            "devices": [
                {"usedMemory": 100, "totalMemory": 1000, "percent": 0.1},
                {"usedMemory": 0, "totalMemory": 0, "percent": 0},
                {"usedMemory": 0, "totalMemory": 0, "percent": 0},
            ],
            "usedMemory": 100,
            "totalMemory": 1000,
            "percent": 0.1,
        }
    }


def test_baetyl_matches_design_example_and_units() -> None:
    snap = snapshot(
        gpu(0, memory_used_bytes=100, memory_total_bytes=1000),
        gpu(1, memory_used_bytes=101, memory_total_bytes=1001),
    )
    node = json.loads(baetyl.render(snap))["n1"]
    assert node["devices"][1]["percent"] == 0.1008991008991009
    assert node["percent"] == 0.10044977511244378
    big = snapshot(gpu(0, memory_used_bytes=3 * GIB, memory_total_bytes=80 * GIB))
    assert json.loads(baetyl.render(big, "MiB"))["n1"]["devices"][0] == {
        "usedMemory": 3072,
        "totalMemory": 81920,
        "percent": 0.0375,
    }


def test_baetyl_used_memory_counts_only_with_a_total_it_fits_in() -> None:
    snap = snapshot(
        gpu(0, memory_used_bytes=1 * GIB, memory_total_bytes=10 * GIB),
        gpu(1, memory_used_bytes=12 * GIB, memory_total_bytes=None),
        gpu(2, memory_used_bytes=1000, memory_total_bytes=500),
    )
    node = json.loads(baetyl.render(snap))["n1"]
    assert [(d["usedMemory"], d["totalMemory"]) for d in node["devices"]] == [
        (GIB, 10 * GIB),
        (0, 0),
        (0, 500),
    ]
    assert (node["usedMemory"], node["totalMemory"]) == (GIB, 10 * GIB + 500)
    assert node["percent"] == GIB / (10 * GIB + 500)


def test_baetyl_node_sums_the_devices_as_shown_in_the_unit() -> None:
    kib = 1024
    snap = snapshot(
        gpu(0, memory_used_bytes=kib + 700, memory_total_bytes=3 * kib + 700),
        gpu(1, memory_used_bytes=kib + 700, memory_total_bytes=3 * kib + 700),
        gpu(2, memory_used_bytes=300, memory_total_bytes=900),
    )
    node = json.loads(baetyl.render(snap, "KiB"))["n1"]
    devices = node["devices"]
    assert [(d["usedMemory"], d["totalMemory"]) for d in devices] == [(1, 3), (1, 3), (0, 0)]
    assert node["usedMemory"] == sum(d["usedMemory"] for d in devices) == 2
    assert node["totalMemory"] == sum(d["totalMemory"] for d in devices) == 6
    assert [d["percent"] for d in devices] == [1 / 3, 1 / 3, 0]
    assert node["percent"] == 2 / 6


def test_counters_never_decrease_across_resets() -> None:
    guard = MonotonicCounters()
    values = [
        guard.gpu(gpu(0, energy_joules=e, xid_errors=((79, x),)), now)
        for now, (e, x) in enumerate([(100.0, 1), (150.0, 2), (10.0, 1), (20.0, 1)], 1)
    ]
    energy = [v.energy_joules for v in values]
    assert energy == [100.0, 150.0, 160.0, 170.0]
    assert [v.xid_errors[0][1] for v in values] == [1, 2, 3, 3]


def test_an_energy_read_no_board_can_reach_adds_nothing() -> None:
    """A garbage read (2**62 mJ once), or a read of 0 taken for a reset and the good one after
    it: the counter grows by what a board can use in the time, at most 5 kW, never by megajoules."""
    guard = MonotonicCounters()
    reads = [1e6, 4.6e15, 1e6 + 50.0, 0.0, 1e6 + 100.0, 1e6 + 150.0]
    energy = [
        guard.gpu(gpu(0, energy_joules=e), 0.25 * n).energy_joules for n, e in enumerate(reads)
    ]
    assert energy == [1e6, 1e6, 1e6, 1e6, 1e6, 1e6 + 50.0]
    # A real reset (a driver reload) counts on from zero, as before.
    assert guard.gpu(gpu(0, energy_joules=20.0), 10.0).energy_joules == 1e6 + 70.0


def test_reliability_and_link_counters_never_decrease_across_resets() -> None:
    guard = MonotonicCounters()

    def reading(raw: int) -> GpuReading:
        return gpu(
            0,
            remapped_rows_uncorrectable=raw,
            retired_pages_double_bit=raw,
            pcie_replays=raw,
            nvlinks=(NvLink(1, True, raw * 1024, raw, (("replay", raw),)), NvLink(2, False)),
            clock_event_seconds=(("power", raw / 2),),
        )

    values = [guard.gpu(reading(raw), now) for now, raw in enumerate((5, 8, 2, 3))]
    assert [v.remapped_rows_uncorrectable for v in values] == [5, 8, 10, 11]
    assert [v.retired_pages_double_bit for v in values] == [5, 8, 10, 11]
    assert [v.pcie_replays for v in values] == [5, 8, 10, 11]
    assert [v.nvlinks[0].transmit_bytes for v in values] == [5120, 8192, 10240, 11264]
    assert [v.nvlinks[0].receive_bytes for v in values] == [5, 8, 10, 11]
    assert [v.nvlinks[0].errors for v in values][-1] == (("replay", 11),)
    assert values[-1].nvlinks[1] == NvLink(2, False)
    assert [v.clock_event_seconds for v in values][-1] == (("power", 5.5),)


def test_reliability_and_link_families() -> None:
    found = families(
        snapshot(
            gpu(
                0,
                memory_reserved_bytes=GIB,
                row_remap_pending=False,
                row_remap_failed=True,
                remapped_rows_correctable=3,
                nvlinks=(NvLink(0, True, 10, 20, (("crc_flit", 1),)), NvLink(1, False)),
                pcie_replays=4,
                clock_event_seconds=(("thermal", 1.5),),
            ),
            gpu(1),
        )
    )
    assert [(s.labels["link"], s.value) for s in found["gpu_nvlink_up"]] == [("0", 1.0), ("1", 0.0)]
    assert [s.labels["link"] for s in found["gpu_nvlink_transmit_bytes"]] == ["0"]
    ((errors),) = found["gpu_nvlink_errors"]
    assert (errors.labels["link"], errors.labels["kind"], errors.value) == ("0", "crc_flit", 1.0)
    assert [(s.labels["cause"], s.value) for s in found["gpu_remapped_rows"]] == [
        ("correctable", 3.0)
    ]
    assert [s.value for s in found["gpu_row_remap_pending"]] == [0.0]
    assert [s.value for s in found["gpu_row_remap_failed"]] == [1.0]
    assert [s.value for s in found["gpu_memory_reserved_bytes"]] == [GIB]
    assert [s.value for s in found["gpu_pcie_replays"]] == [4.0]
    assert [(s.labels["reason"], s.value) for s in found["gpu_clock_event_seconds"]] == [
        ("thermal", 1.5)
    ]
    # what the GPUs cannot report is absent, never zero
    assert "gpu_retired_pages" not in found and "gpu_retired_pages_pending" not in found
    assert {s.labels["gpu"] for s in found["gpu_nvlink_up"]} == {"0"}


def test_container_totals_survive_processes_leaving() -> None:
    guard = MonotonicCounters()

    def totals(*processes: ProcessCpu) -> tuple[tuple[str, float], ...]:
        return guard.containers(guard.cpu_increases(processes))

    assert totals(ProcessCpu(1, "a", 2.0, "c1"), ProcessCpu(2, "b", 3.0, "c1")) == (("c1", 5.0),)
    assert totals(ProcessCpu(1, "a", 4.0, "c1")) == (("c1", 7.0),)
    assert totals(ProcessCpu(1, "a", 4.0, "c1"), ProcessCpu(3, "c", 1.0, "c1")) == (("c1", 8.0),)


def test_rows_without_gpu_energy_have_no_gpu_energy_series() -> None:
    web, train = PodRef("shop", "web-1", "nginx"), PodRef("ml", "train-0", "main")
    energy = Energy(
        cpu_zones=(CpuZoneEnergy("package", "rapl", 10.0),),
        gpu_idle=(("GPU-0", 5.0),),
        cpu_processes=(
            WorkloadEnergy("1", "kthreadd", cpu_joules=0.0),
            WorkloadEnergy("7", "train", "c3", train, cpu_joules=1.0),
        ),
        gpu_processes=(
            WorkloadEnergy("7", "train", "c3", train, gpu_joules=30.0),
            WorkloadEnergy(pid="other", gpu_joules=0.0),
        ),
        containers=(
            WorkloadEnergy(container_id="c1", owner=web, cpu_joules=5.0),
            WorkloadEnergy(container_id="c3", owner=train, cpu_joules=1.0, gpu_joules=30.0),
        ),
        pods=(
            WorkloadEnergy(owner=PodRef("ml", "train-0"), cpu_joules=1.0, gpu_joules=30.0),
            WorkloadEnergy(owner=PodRef("shop", "web-1"), cpu_joules=5.0),
        ),
    )
    snap = dataclasses.replace(snapshot(gpu(0, energy_joules=40.0)), energy=energy)
    for devices in (None, dcgm.families):
        text = prometheus.render(snap, lambda name: True, devices=devices).decode()

        def rows(name: str, label: str) -> list[str]:
            return [s.labels[label] for s in scaffold.samples(text, name)]

        assert rows("kepler_bridge_process_gpu_joules_total", "pid") == ["7"], devices
        assert rows("kepler_bridge_container_gpu_joules_total", "container_id") == ["c3"]
        assert rows("kepler_bridge_pod_gpu_joules_total", "pod") == ["train-0"]
        # CPU rows are every process's, container's and pod's, as before.
        assert rows("kepler_bridge_process_cpu_joules_total", "pid") == ["1", "7"]
        assert rows("kepler_bridge_container_cpu_joules_total", "container_id") == ["c1", "c3"]
        assert rows("kepler_bridge_pod_cpu_joules_total", "pod") == ["train-0", "web-1"]
