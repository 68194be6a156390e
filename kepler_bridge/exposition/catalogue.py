"""Every exported metric: its name, help and labels, and the tables the collector emits from."""

from __future__ import annotations

GPU_LABELS = ("node", "gpu", "uuid", "vendor", "model")
POD_LABELS = ("namespace", "pod", "container")
PROCESS_LABELS = GPU_LABELS + ("pid", "comm") + POD_LABELS
# A MIG device (compute instance of a GPU instance), and a GPU instance with its profile.
MIG_DEVICE_LABELS = GPU_LABELS + ("gpu_instance", "compute_instance", "mig_uuid")
MIG_INSTANCE_LABELS = GPU_LABELS + ("gpu_instance", "profile")
# Labels of the energy levels: WorkloadEnergy's own attribute names, then its owner's (PodRef).
ENERGY_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "process": (("pid", "comm", "container_id"), POD_LABELS),
    "container": (("container_id",), POD_LABELS),
    "pod": ((), ("namespace", "pod")),
}
# Attributed energy in the order it is exposed: exposed name, level (labels in ENERGY_LEVELS), kind.
ENERGY_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kepler_bridge_process_cpu_joules_total", "process", "cpu"),
    ("kepler_bridge_process_gpu_joules_total", "process", "gpu"),
    ("kepler_bridge_container_cpu_joules_total", "container", "cpu"),
    ("kepler_bridge_container_gpu_joules_total", "container", "gpu"),
    ("kepler_bridge_pod_cpu_joules_total", "pod", "cpu"),
    ("kepler_bridge_pod_gpu_joules_total", "pod", "gpu"),
)

# Plain gauges of a GPU reading: exposed name -> (reading attribute, help).
GPU_GAUGES: dict[str, tuple[str, str]] = {
    "gpu_utilization_ratio": (
        "utilization",
        "Fraction of time a kernel ran on the accelerator (0..1).",
    ),
    "gpu_memory_utilization_ratio": (
        "memory_utilization",
        "Fraction of time device memory was read or written (0..1).",
    ),
    "gpu_encoder_utilization_ratio": ("encoder_utilization", "Video encoder utilization (0..1)."),
    "gpu_decoder_utilization_ratio": ("decoder_utilization", "Video decoder utilization (0..1)."),
    "gpu_memory_used_bytes": ("memory_used_bytes", "Device memory in use."),
    "gpu_memory_total_bytes": ("memory_total_bytes", "Device memory size."),
    "gpu_memory_free_bytes": ("memory_free_bytes", "Device memory free."),
    "gpu_memory_reserved_bytes": (
        "memory_reserved_bytes",
        "Device memory the driver reserves for itself, not usable by processes.",
    ),
    "gpu_row_remap_pending": (
        "row_remap_pending",
        "1 while a memory row remap waits for a GPU reset to take effect.",
    ),
    "gpu_row_remap_failed": (
        "row_remap_failed",
        "1 once a memory row remap failed: the GPU needs servicing.",
    ),
    "gpu_retired_pages_pending": (
        "retired_pages_pending",
        "1 while a page retirement waits for a GPU reset or reboot to take effect.",
    ),
    "gpu_temperature_celsius": ("temperature_celsius", "Accelerator core temperature."),
    "gpu_memory_temperature_celsius": (
        "memory_temperature_celsius",
        "Accelerator memory temperature.",
    ),
    "gpu_power_watts": ("power_watts", "Power draw."),
    "gpu_power_limit_watts": ("power_limit_watts", "Enforced power limit."),
    "gpu_sm_clock_hertz": ("sm_clock_hertz", "SM (core) clock."),
    "gpu_memory_clock_hertz": ("memory_clock_hertz", "Memory clock."),
    "gpu_fan_speed_ratio": (
        "fan_speed_ratio",
        "Fan speed as a fraction of its rated maximum (above 1 where the driver says so).",
    ),
    "gpu_pcie_transmit_bytes_per_second": (
        "pcie_transmit_bytes_per_second",
        "PCIe transmit throughput over 20 ms, measured once per --nvml-counter-interval.",
    ),
    "gpu_pcie_receive_bytes_per_second": (
        "pcie_receive_bytes_per_second",
        "PCIe receive throughput over 20 ms, measured once per --nvml-counter-interval.",
    ),
    "gpu_performance_state": ("performance_state", "Performance state P0 (max) .. P15 (min)."),
    "gpu_last_xid_timestamp_seconds": ("last_xid_timestamp", "Unix time of the last XID error."),
}

# Profiling gauges from GPM (NVIDIA Hopper and newer), over the time between the agent's last two
# GPM samples: exposed name -> (reading attribute, help).
PROFILING_GAUGES: dict[str, tuple[str, str]] = {
    "gpu_sm_active_ratio": (
        "sm_active",
        "Fraction of SMs busy (0..1); gpu_utilization_ratio counts the time any kernel ran, "
        "however few SMs it kept busy.",
    ),
    "gpu_sm_occupancy_ratio": (
        "sm_occupancy",
        "Resident warps as a fraction of the most the SMs can hold (0..1).",
    ),
    "gpu_graphics_active_ratio": (
        "graphics_active",
        "Fraction of time the graphics or compute engine was active (0..1); "
        "GPM's measure of what gpu_utilization_ratio samples.",
    ),
    "gpu_tensor_active_ratio": (
        "tensor_active",
        "Fraction of time the SMs' tensor cores were busy, any precision (0..1).",
    ),
    "gpu_dram_active_ratio": (
        "dram_active",
        "Device memory bandwidth used as a fraction of its peak (0..1); "
        "gpu_memory_utilization_ratio counts the time memory was accessed at all.",
    ),
    "gpu_profiled_pcie_transmit_bytes_per_second": (
        "profiled_pcie_transmit_bytes_per_second",
        "PCIe traffic from the accelerator, measured by GPM.",
    ),
    "gpu_profiled_pcie_receive_bytes_per_second": (
        "profiled_pcie_receive_bytes_per_second",
        "PCIe traffic to the accelerator, measured by GPM.",
    ),
    "gpu_profiled_nvlink_transmit_bytes_per_second": (
        "profiled_nvlink_transmit_bytes_per_second",
        "NVLink traffic sent over all links, measured by GPM.",
    ),
    "gpu_profiled_nvlink_receive_bytes_per_second": (
        "profiled_nvlink_receive_bytes_per_second",
        "NVLink traffic received over all links, measured by GPM.",
    ),
}
# Profiling gauges with a label of their own: exposed name -> (reading attribute, label, help).
PROFILING_LABELLED: dict[str, tuple[str, str, str]] = {
    "gpu_pipe_active_ratio": (
        "pipe_active",
        "pipe",
        "Fraction of time the SMs kept this pipe busy (0..1): tensor_hmma, tensor_imma, "
        "tensor_dfma, fp64, fp32, fp16 (not tensor) or integer.",
    ),
    "gpu_engine_active_ratio": (
        "engine_active",
        "engine",
        "Utilization of a media engine (0..1), averaged over its instances: nvdec, nvjpg, nvofa.",
    ),
}
# GPM profiling of a MIG GPU instance (nvmlGpmMigSampleGet), as PROFILING_GAUGES over its
# slices: exposed name -> (MigInstance attribute, help).
MIG_PROFILING: dict[str, tuple[str, str]] = {
    "gpu_mig_sm_active_ratio": ("sm_active", "Fraction of a MIG GPU instance's SMs busy (0..1)."),
    "gpu_mig_sm_occupancy_ratio": (
        "sm_occupancy",
        "Resident warps as a fraction of the most a MIG GPU instance's SMs can hold (0..1).",
    ),
    "gpu_mig_graphics_active_ratio": (
        "graphics_active",
        "Fraction of time a MIG GPU instance's graphics or compute engine was active (0..1).",
    ),
    "gpu_mig_tensor_active_ratio": (
        "tensor_active",
        "Fraction of time a MIG GPU instance's tensor cores were busy, any precision (0..1).",
    ),
    "gpu_mig_dram_active_ratio": (
        "dram_active",
        "Memory bandwidth a MIG GPU instance used as a fraction of its peak (0..1).",
    ),
}

# Every metric this module can emit, with its help text; the README lists exactly these.
METRICS: dict[str, str] = {
    "gpu_info": "Accelerator metadata; value 1.",
    "gpu_pod_info": (
        "The one container the kubelet assigned the accelerator to; source: pod-resources or "
        "environment; value 1."
    ),
    "gpu_up": "1 when the accelerator is readable, 0 when lost or failing.",
    **{name: help_text for name, (_, help_text) in GPU_GAUGES.items()},
    **{name: help_text for name, (_, help_text) in PROFILING_GAUGES.items()},
    **{name: help_text for name, (_, _, help_text) in PROFILING_LABELLED.items()},
    "gpu_energy_joules_total": "Energy consumed by the accelerator.",
    "gpu_throttled": "1 while the clocks are held down for this reason.",
    "gpu_ecc_errors_total": "ECC memory errors since the driver loaded, by kind.",
    "gpu_xid_errors_total": "XID errors reported by the driver, by XID code.",
    "gpu_nvlink_up": "1 while the NVLink is active, 0 while it is down.",
    "gpu_nvlink_transmit_bytes_total": "Data bytes sent over the NVLink since the driver loaded.",
    "gpu_nvlink_receive_bytes_total": (
        "Data bytes received over the NVLink since the driver loaded."
    ),
    "gpu_nvlink_errors_total": (
        "NVLink data-link errors by kind: crc_flit, crc_data, replay, recovery."
    ),
    "gpu_remapped_rows_total": (
        "Memory rows remapped to spare rows, by the cause: correctable or uncorrectable errors."
    ),
    "gpu_retired_pages_total": (
        "Memory pages retired, by cause: single_bit (repeated single-bit ECC errors) or double_bit."
    ),
    "gpu_pcie_replays_total": "PCIe replays: packets resent after link errors.",
    "gpu_clock_event_seconds_total": (
        "Time the clocks were held below the requested ones, by reason, since the driver loaded."
    ),
    "gpu_process_memory_used_bytes": "Device memory used by a process.",
    "gpu_process_utilization_ratio": "SM utilization of a process on the accelerator (0..1).",
    "gpu_mig_info": "A MIG device of a GPU in MIG mode, with its GPU instance profile; value 1.",
    "gpu_mig_pod_info": "The one container the kubelet assigned the MIG device to; value 1.",
    "gpu_mig_memory_used_bytes": "Device memory in use in a MIG GPU instance.",
    "gpu_mig_memory_total_bytes": "Device memory size of a MIG GPU instance.",
    **{name: help_text for name, (_, help_text) in MIG_PROFILING.items()},
    "kepler_bridge_process_cpu_seconds_total": "CPU time used by a process.",
    "kepler_bridge_container_cpu_seconds_total": "CPU time used by the processes of a container.",
    "kepler_bridge_node_cpu_joules_total": (
        "CPU energy of the node by RAPL zone (or estimated from cpu_tdp_watts)."
    ),
    "kepler_bridge_node_gpu_idle_joules_total": (
        "Accelerator energy not attributed to processes: its idle part."
    ),
    "kepler_bridge_node_gpu_unattributed_joules_total": (
        "Active accelerator energy of a device without process data "
        "that no single container holds, by reason."
    ),
    "kepler_bridge_process_cpu_joules_total": "CPU energy attributed to a process by its CPU time.",
    "kepler_bridge_process_gpu_joules_total": (
        "Accelerator energy attributed to a process by its SM utilization."
    ),
    "kepler_bridge_container_cpu_joules_total": (
        "CPU energy attributed to the processes of a container."
    ),
    "kepler_bridge_container_gpu_joules_total": (
        "Accelerator energy attributed to the processes of a container."
    ),
    "kepler_bridge_pod_cpu_joules_total": "CPU energy attributed to the processes of a pod.",
    "kepler_bridge_pod_gpu_joules_total": (
        "Accelerator energy attributed to the processes of a pod."
    ),
    "kepler_bridge_build_info": "Agent build metadata; value 1.",
    "kepler_bridge_source_up": (
        "1 when the source was read in the last sample, 0 when it failed; sources in use only."
    ),
    "kepler_bridge_source_state": (
        "1 for the source's state (up, down, standby, absent), 0 for the others."
    ),
    "kepler_bridge_source_errors_total": (
        "Failed reads or starts of the source; sources in use only."
    ),
    "kepler_bridge_sample_duration_seconds": "Time the last sample took to read every source.",
    "kepler_bridge_last_sample_timestamp_seconds": "Unix time of the last published sample.",
    "kepler_bridge_ebpf_programs_attached": "eBPF programs attached by the agent.",
    "kepler_bridge_state_save_errors_total": (
        "Failed saves of the counter state a new worker continues from."
    ),
    "gpu_anomaly_score": (
        "The device's IsolationForest anomaly score (0..1; about 0.5 and below is ordinary)."
    ),
    "gpu_anomaly": "1 while the anomaly detector of this kind fires on the device, else 0.",
    "kepler_bridge_anomaly_model_fitted_timestamp_seconds": (
        "Unix time the device's IsolationForest was last fitted."
    ),
    "kepler_bridge_anomaly_cpu_seconds_total": (
        "CPU time of the anomaly detection: its thread, its fit thread and the fit's child."
    ),
}

# Exported whatever the allow/deny lists say: alerts and dashboards need them to tell "down"
# from "filtered".
HEALTH = frozenset(
    {
        "gpu_up",
        "kepler_bridge_source_up",
        "kepler_bridge_source_state",
        "kepler_bridge_build_info",
        "kepler_bridge_last_sample_timestamp_seconds",
    }
)
