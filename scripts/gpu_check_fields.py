"""What `scripts/gpu-check.sh` compares: nvidia-smi's fields against kepler-bridge's series.

Pure functions of parsed readings, so tests/test_gpu_check.py can drive them without a GPU.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import Iterable

MIB = 2**20
# What nvidia-smi prints for a value the GPU cannot report.
NOT_AVAILABLE = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", ""}

# Bits of nvidia-smi's clocks_event_reasons.active, named as gpu_throttled's reasons; written
# out here, not imported from kepler_bridge, so that the check does not trust the code it checks.
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
THROTTLE_MASK = sum(THROTTLE_BITS.values())

Value = float | str | None
# One parse of /metrics: sample name -> [(labels, value)].
Scrape = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Field:
    """One row of the table: an nvidia-smi field and the series of ours that should match it.

    `smi` lists the field's names, newest first (the first one this nvidia-smi knows is asked);
    ours times `scale` is in nvidia-smi's unit; a value within `absolute` or `relative` of the
    range of the two nvidia-smi reads around ours agrees. `kind`: number, text (a label of
    `metric`, named by `label`), pstate (P0..P15), bitmask (gpu_throttled), yesno (0/1)."""

    metric: str
    smi: tuple[str, ...]
    scale: float = 1.0
    absolute: float = 0.0
    relative: float = 0.0
    kind: str = "number"
    label: str = ""
    selector: tuple[tuple[str, str], ...] = ()

    @property
    def row(self) -> str:
        """The row's name: the series, with its selecting labels or the label compared."""
        if self.label:
            return f"{self.metric} {self.label}"
        inner = ",".join(f'{key}="{value}"' for key, value in self.selector)
        return f"{self.metric}{{{inner}}}" if inner else self.metric


def _ecc(kind: str) -> Field:
    return Field(
        "gpu_ecc_errors_total",
        (f"ecc.errors.{kind}.volatile.total",),
        selector=(("kind", kind),),
    )


FIELDS: tuple[Field, ...] = (
    # Our node-wide index is NVML's where NVML is the only source.
    Field("gpu_up", ("index",), kind="text", label="gpu"),
    Field("gpu_info", ("name",), kind="text", label="model"),
    Field("gpu_info", ("driver_version",), kind="text", label="driver_version"),
    Field("gpu_info", ("pci.bus_id",), kind="text", label="pci_bus_id"),
    # Utilization moves between reads: bracketed by the two reads, and 10 points either side.
    Field("gpu_utilization_ratio", ("utilization.gpu",), 100, absolute=10),
    Field("gpu_memory_utilization_ratio", ("utilization.memory",), 100, absolute=10),
    Field("gpu_encoder_utilization_ratio", ("utilization.encoder",), 100, absolute=10),
    Field("gpu_decoder_utilization_ratio", ("utilization.decoder",), 100, absolute=10),
    # nvidia-smi prints whole MiB.
    Field("gpu_memory_used_bytes", ("memory.used",), 1 / MIB, absolute=2, relative=0.01),
    Field("gpu_memory_total_bytes", ("memory.total",), 1 / MIB, absolute=1),
    Field("gpu_memory_free_bytes", ("memory.free",), 1 / MIB, absolute=2, relative=0.01),
    Field("gpu_memory_reserved_bytes", ("memory.reserved",), 1 / MIB, absolute=1),
    Field("gpu_temperature_celsius", ("temperature.gpu",), absolute=2),
    Field("gpu_memory_temperature_celsius", ("temperature.memory",), absolute=2),
    # NVML's power reading and nvidia-smi's may average over different windows.
    Field("gpu_power_watts", ("power.draw",), absolute=10, relative=0.1),
    Field("gpu_power_limit_watts", ("enforced.power.limit", "power.limit"), absolute=0.5),
    Field("gpu_sm_clock_hertz", ("clocks.sm",), 1e-6, absolute=15),
    Field("gpu_memory_clock_hertz", ("clocks.mem",), 1e-6, absolute=1),
    Field("gpu_fan_speed_ratio", ("fan.speed",), 100, absolute=1),
    Field("gpu_performance_state", ("pstate",), kind="pstate"),
    Field(
        "gpu_throttled",
        ("clocks_event_reasons.active", "clocks_throttle_reasons.active"),
        kind="bitmask",
    ),
    _ecc("corrected"),
    _ecc("uncorrected"),
    Field(
        "gpu_retired_pages_total",
        ("retired_pages.single_bit_ecc.count", "retired_pages.sbe"),
        selector=(("cause", "single_bit"),),
    ),
    Field(
        "gpu_retired_pages_total",
        ("retired_pages.double_bit.count", "retired_pages.dbe"),
        selector=(("cause", "double_bit"),),
    ),
    Field("gpu_retired_pages_pending", ("retired_pages.pending",), kind="yesno"),
    # From `nvidia-smi --query-remapped-rows`.
    Field(
        "gpu_remapped_rows_total",
        ("remapped_rows.correctable",),
        selector=(("cause", "correctable"),),
    ),
    Field(
        "gpu_remapped_rows_total",
        ("remapped_rows.uncorrectable",),
        selector=(("cause", "uncorrectable"),),
    ),
    Field("gpu_row_remap_pending", ("remapped_rows.pending",), kind="yesno"),
    Field("gpu_row_remap_failed", ("remapped_rows.failure",), kind="yesno"),
)
# Shown from nvidia-smi for the record; kepler-bridge has no series of them.
SMI_ONLY = ("pcie.link.gen.current", "pcie.link.width.current", "mig.mode.current")
REMAPPED_ROWS = tuple(
    name for field in FIELDS for name in field.smi if name.startswith("remapped_rows.")
)

# The families of issue 16 that other parts add: reported present or absent, not compared.
GPM_FAMILIES = (
    "gpu_sm_active_ratio",
    "gpu_sm_occupancy_ratio",
    "gpu_graphics_active_ratio",
    "gpu_tensor_active_ratio",
    "gpu_pipe_active_ratio",
    "gpu_dram_active_ratio",
    "gpu_profiled_pcie_transmit_bytes_per_second",
    "gpu_profiled_pcie_receive_bytes_per_second",
    "gpu_profiled_nvlink_transmit_bytes_per_second",
    "gpu_profiled_nvlink_receive_bytes_per_second",
    "gpu_engine_active_ratio",
)
LINK_FAMILIES = (
    "gpu_nvlink_up",
    "gpu_nvlink_transmit_bytes_total",
    "gpu_nvlink_receive_bytes_total",
    "gpu_nvlink_errors_total",
    "gpu_remapped_rows_total",
    "gpu_row_remap_pending",
    "gpu_row_remap_failed",
    "gpu_retired_pages_total",
    "gpu_retired_pages_pending",
    "gpu_pcie_replays_total",
    "gpu_memory_reserved_bytes",
    "gpu_clock_event_seconds_total",
)


def parse_smi_csv(text: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Rows of `--format=csv,noheader,nounits` whose first column is the uuid, by uuid."""
    rows = {}
    for cells in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(cells) == len(names):
            values = dict(zip(names, (cell.strip() for cell in cells)))
            rows[values[names[0]]] = values
    return rows


def smi_value(field: Field, text: str | None) -> Value:
    """nvidia-smi's text as the field's value; None where it cannot report it."""
    if text is None or text.strip().lower() in NOT_AVAILABLE:
        return None
    text = text.strip()
    try:
        if field.kind == "text":
            return text
        if field.kind == "pstate":
            return float(text.lstrip("Pp"))
        if field.kind == "bitmask":
            return float(int(text, 16) & THROTTLE_MASK)
        if field.kind == "yesno":
            words = {"yes": 1.0, "no": 0.0}
            return words[text.lower()] if text.lower() in words else float(text)
        return float(text)
    except ValueError:
        return None


def parse_metrics(text: str) -> Scrape:
    """Prometheus text by sample name (prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            scrape.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return scrape


def device_series(scrape: Scrape, metric: str, uuid: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one family for one device."""
    return [
        (labels, value) for labels, value in scrape.get(metric, []) if labels.get("uuid") == uuid
    ]


def ours(scrape: Scrape, field: Field, uuid: str) -> Value:
    """Our value for the field, in nvidia-smi's unit; None where we export no series."""
    series = [
        (labels, value)
        for labels, value in device_series(scrape, field.metric, uuid)
        if all(labels.get(key) == wanted for key, wanted in field.selector)
    ]
    if not series:
        return None
    if field.kind == "text":
        return series[0][0].get(field.label)
    if field.kind == "bitmask":
        return float(sum(THROTTLE_BITS.get(labels["reason"], 0) for labels, on in series if on))
    return series[0][1] * field.scale


@dataclass(frozen=True)
class Verdict:
    """One comparison: ours against nvidia-smi's reads just before and just after it."""

    ours: Value
    smi: tuple[Value, ...]
    agree: bool
    supported: str


def compare(field: Field, mine: Value, before: Value, after: Value) -> Verdict:
    """Agree when both report nothing, or ours lies within tolerance of the reads' range."""
    theirs = tuple(value for value in (before, after) if value is not None)
    if mine is None or not theirs:
        supported = {(True, True): "neither", (True, False): "nvidia-smi only"}.get(
            (mine is None, not theirs), "ours only"
        )
        return Verdict(mine, theirs, supported == "neither", supported)
    if field.kind == "text":
        agree = str(mine).lower() in {str(value).lower() for value in theirs}
        return Verdict(mine, theirs, agree, "both")
    low, high = min(theirs), max(theirs)
    assert isinstance(mine, float) and isinstance(low, float) and isinstance(high, float)
    margin = max(field.absolute, field.relative * abs(high))
    return Verdict(mine, theirs, low - margin <= mine <= high + margin, "both")


def show(value: Value) -> str:
    """A value for the table: whole numbers without a fraction, others to 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.0f}" if value == int(value) else f"{value:.4g}"


def table(rows: Iterable[tuple[str, ...]]) -> str:
    """Rows as aligned columns, the first row a header."""
    rows = list(rows)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )
