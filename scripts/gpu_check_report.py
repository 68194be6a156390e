"""The table of `scripts/gpu-check.sh`: per GPU, each field, ours, nvidia-smi's, agree or not."""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass

from gpu_check_fields import (
    FIELDS,
    GPM_FAMILIES,
    LINK_FAMILIES,
    SMI_ONLY,
    Field,
    Scrape,
    Verdict,
    compare,
    device_series,
    ours,
    show,
    smi_value,
    table,
)

HEAD = ("series", "nvidia-smi field", "ours", "nvidia-smi", "agree", "supported", "serve")
# The mean power of the serve window against the energy counter's rate over it.
ENERGY_TOLERANCE = (10.0, 0.15)


class Failed(Exception):
    """kepler-bridge itself failed: its exit status and output."""


@dataclass(frozen=True)
class Reading:
    """One scrape of ours and the nvidia-smi reads just before and just after it, by uuid."""

    scrape: Scrape
    before: dict[str, dict[str, str]]
    after: dict[str, dict[str, str]]
    seconds: float  # from the read before to the read after


def header(version: str, doctor: subprocess.CompletedProcess[str]) -> str:
    """Who checked what: versions and what `kepler-bridge doctor` says of NVML."""
    nvml = [line for line in doctor.stdout.splitlines() if " nvml " in f" {line} "]
    return "\n".join(
        [
            f"gpu-check: {version.strip()}, Python {platform.python_version()} on "
            f"{platform.machine()}; read-only (no setting of the card was changed)",
            f"doctor: {nvml[0] if nvml else doctor.stdout.strip() or doctor.stderr.strip()}",
        ]
    )


def _verdict(entry: Field, name: str, reading: Reading, uuid: str) -> Verdict:
    return compare(
        entry,
        ours(reading.scrape, entry, uuid),
        smi_value(entry, reading.before.get(uuid, {}).get(name)),
        smi_value(entry, reading.after.get(uuid, {}).get(name)),
    )


def field_rows(
    asked: list[str], once: Reading, served: list[Reading], uuid: str, known: set[str]
) -> tuple[list[tuple[str, ...]], int]:
    """The rows of one GPU's fields and how many of them disagree."""
    rows: list[tuple[str, ...]] = []
    disagree = 0
    for entry in FIELDS:
        name = next((candidate for candidate in entry.smi if candidate in asked), "")
        if not name:
            continue
        first = _verdict(entry, name, once, uuid)
        if entry.metric not in known:
            smi = "..".join(sorted({show(value) for value in first.smi})) or "-"
            rows.append((entry.row, name, "-", smi, "-", "not in this build", "-"))
            continue
        later = [_verdict(entry, name, reading, uuid) for reading in served]
        agree = first.agree and all(verdict.agree for verdict in later)
        disagree += not agree
        smi = "..".join(sorted({show(value) for value in first.smi})) or "-"
        serve = f"{sum(v.agree for v in later)}/{len(later)}" if later else "-"
        rows.append(
            (
                entry.row,
                name,
                show(first.ours),
                smi,
                "yes" if agree else "NO",
                first.supported,
                serve,
            )
        )
    for name in SMI_ONLY:
        if name in asked:
            value = once.before.get(uuid, {}).get(name, "-")
            rows.append(("-", name, "-", value, "-", "nvidia-smi only", "-"))
    return rows, disagree


def energy_row(served: list[Reading], uuid: str) -> tuple[tuple[str, ...] | None, int]:
    """gpu_energy_joules_total's rate over the serve window against nvidia-smi's mean power."""
    if len(served) < 2:
        return None, 0
    points = []
    for reading in (served[0], served[-1]):
        energy = device_series(reading.scrape, "gpu_energy_joules_total", uuid)
        stamp = reading.scrape.get("kepler_bridge_last_sample_timestamp_seconds", [])
        if not energy or not stamp:
            return None, 0
        points.append((stamp[0][1], energy[0][1]))
    powers = [
        float(read[uuid]["power.draw"])
        for reading in served
        for read in (reading.before, reading.after)
        if read.get(uuid, {}).get("power.draw", "").replace(".", "", 1).isdigit()
    ]
    (start, first), (end, last) = points
    if end <= start or not powers:
        return None, 0
    rate, mean = (last - first) / (end - start), sum(powers) / len(powers)
    agree = abs(rate - mean) <= max(ENERGY_TOLERANCE[0], ENERGY_TOLERANCE[1] * mean)
    row = (
        "rate(gpu_energy_joules_total)",
        "mean power.draw",
        show(round(rate, 1)),
        show(round(mean, 1)),
        "yes" if agree else "NO",
        "both",
        f"{end - start:.0f} s",
    )
    return row, int(not agree)


def family_rows(reading: Reading, uuids: list[str], known: set[str]) -> list[tuple[str, ...]]:
    """Issue 16's GPM, NVLink and reliability families: on how many GPUs each is present."""
    rows: list[tuple[str, ...]] = [("family", "in this build", "GPUs with it", "series", "values")]
    for family in GPM_FAMILIES + LINK_FAMILIES:
        series = [found for uuid in uuids for found in device_series(reading.scrape, family, uuid)]
        having = {labels["uuid"] for labels, _ in series}
        values = sorted(value for _, value in series)
        shown = f"{show(values[0])}..{show(values[-1])}" if values else "-"
        in_build = "yes" if family in known else "no"
        rows.append((family, in_build, f"{len(having)}/{len(uuids)}", str(len(series)), shown))
    return rows


def ratio_problems(readings: list[Reading]) -> list[str]:
    """Every *_ratio sample outside 0..1, in any reading."""
    return sorted(
        {
            f"{name}{labels} = {value}"
            for reading in readings
            for name, samples in reading.scrape.items()
            if name.endswith("_ratio")
            for labels, value in samples
            if not 0 <= value <= 1
        }
    )


def counter_problems(served: list[Reading]) -> list[str]:
    """Every *_total series that went down between two scrapes of the serve window."""
    found = set()
    for earlier, later in zip(served, served[1:]):
        for name, samples in later.scrape.items():
            if not name.endswith("_total"):
                continue
            before = {
                tuple(sorted(labels.items())): value
                for labels, value in earlier.scrape.get(name, [])
            }
            for labels, value in samples:
                key = tuple(sorted(labels.items()))
                if key in before and value < before[key]:
                    found.add(f"{name}{dict(key)}: {before[key]} -> {value}")
    return sorted(found)


def render(head: str, asked: list[str], once: Reading, served: list[Reading]) -> tuple[str, bool]:
    """The whole report and whether everything agreed."""
    from kepler_bridge.exposition.catalogue import METRICS

    known = set(METRICS)
    uuids = sorted(set(once.before) | set(once.after))
    parts, disagree = [head], 0
    for uuid in uuids:
        rows, wrong = field_rows(asked, once, served, uuid, known)
        energy, bad = energy_row(served, uuid)
        rows += [energy] if energy else []
        disagree += wrong + bad
        name = once.before.get(uuid, {}).get("name", "")
        parts += [f"\nGPU {uuid} {name}", table([HEAD, *rows])]
    last = served[-1] if served else once
    families = table(family_rows(last, uuids, known))
    parts += ["\nGPM, NVLink and reliability families (last scrape): present or absent", families]
    ours_only = sorted({labels["uuid"] for labels, _ in once.scrape.get("gpu_up", [])} - set(uuids))
    problems = ratio_problems([once, *served]) + counter_problems(served)
    problems += [f"kepler-bridge reports {uuid}, nvidia-smi does not" for uuid in ours_only]
    parts += [f"problem: {problem}" for problem in problems]
    ok = disagree == 0 and not problems and bool(uuids)
    window = max(reading.seconds for reading in [once, *served])
    parts.append(
        f"\ngpu-check: {len(uuids)} GPU(s), {disagree} row(s) disagree, {len(problems)} "
        f"problem(s), collect and {len(served)} scrape(s) of serve, each within {window:.1f} s "
        f"of nvidia-smi reads: {'AGREE' if ok else 'DISAGREE'}"
    )
    return "\n".join(parts), ok
