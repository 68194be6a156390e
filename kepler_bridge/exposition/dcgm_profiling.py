"""dcgm-exporter's profiling fields (DCGM_FI_PROF_*), from GPM: ratios 0..1 as DCGM gives them, and
bytes per second."""

from __future__ import annotations

from kepler_bridge.exposition.dcgm_fields import Field, keyed, scaled

# In the order of the exposition, after the device fields.
PROFILING: tuple[Field, ...] = (
    Field(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        scaled("graphics_active", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_SM_ACTIVE",
        "gauge",
        "The ratio of cycles an SM has at least 1 warp assigned.",
        scaled("sm_active", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "gauge",
        "The ratio of number of warps resident on an SM.",
        scaled("sm_occupancy", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles any tensor pipe is active.",
        scaled("tensor_active", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        scaled("dram_active", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        "gauge",
        "Ratio of cycles the fp64 pipes are active.",
        keyed("pipe_active", "fp64", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "gauge",
        "Ratio of cycles the fp32 pipes are active.",
        keyed("pipe_active", "fp32", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        "gauge",
        "Ratio of cycles the fp16 pipes are active.",
        keyed("pipe_active", "fp16", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        keyed("pipe_active", "tensor_hmma", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (IMMA) pipe is active.",
        keyed("pipe_active", "tensor_imma", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (DFMA) pipe is active.",
        keyed("pipe_active", "tensor_dfma", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PIPE_INT_ACTIVE",
        "gauge",
        "Ratio of cycles the integer pipe is active.",
        keyed("pipe_active", "integer", whole=None),
    ),
    Field(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "The rate of data transmitted over the PCIe bus, headers included (in B/s).",
        scaled("profiled_pcie_transmit_bytes_per_second"),
    ),
    Field(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "The rate of data received over the PCIe bus, headers included (in B/s).",
        scaled("profiled_pcie_receive_bytes_per_second"),
    ),
    Field(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "gauge",
        "The rate of data transmitted over NVLink (in B/s).",
        scaled("profiled_nvlink_transmit_bytes_per_second"),
    ),
    Field(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "gauge",
        "The rate of data received over NVLink (in B/s).",
        scaled("profiled_nvlink_receive_bytes_per_second"),
    ),
)
