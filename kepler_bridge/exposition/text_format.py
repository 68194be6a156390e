"""The Prometheus text and OpenMetrics formats of metric families, byte for byte as
prometheus_client writes them, at about a third of its cost: each name is checked and escaped once
per sample name and label keys, not once per sample (`benchmarks/sample_cost.py` prints both).

A family it does not cover (a type other than counter, gauge, info and unknown, a unit, or a
sample with a timestamp, an exemplar, a native histogram or a suffix the text format moves) goes
to prometheus_client's writer, so the output never differs from it.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.exposition import generate_latest as library_text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import (
    UNDERSCORES,
    _escape,
    _is_legacy_labelname_rune,
    escape_label_name,
    escape_metric_name,
)
from prometheus_client.openmetrics.exposition import generate_latest as library_openmetrics
from prometheus_client.utils import floatToGoString

from kepler_bridge.turns import TURNS

# Family type -> (suffix of its name, type written) in the text format; OpenMetrics keeps both.
TEXT_TYPES = {
    "counter": ("_total", "counter"),
    "gauge": ("", "gauge"),
    "info": ("_info", "gauge"),
    "unknown": ("", "untyped"),
}
# Samples the text format moves into families of their own: the library's writer handles them.
MOVED_SUFFIXES = ("_created", "_gsum", "_gcount")
# The templates a format keeps; past this (label keys from plug-ins, say) it starts afresh.
MOST_TEMPLATES = 4096


class Families:
    """Stands in for a registry: prometheus_client's writers collect the families it holds."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _escaped(value: str) -> str:
    """A label value or OpenMetrics HELP text with its backslashes, newlines and quotes escaped."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _needs_escapes(text: str) -> bool:
    """Whether a label value (or all of a sample's, joined) holds a character to escape."""
    return "\\" in text or "\n" in text or '"' in text


class _Lines:
    """Formats of the sample lines of one format: a template per sample name and label keys.
    Renders in several threads share it: each reads and writes the dict whole, atomic under the
    GIL, and a template made twice is the same."""

    def __init__(self, openmetrics: bool) -> None:
        self.openmetrics = openmetrics
        self.templates: dict[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]] = {}

    def template(self, name: str, keys: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """The line up to its value, as a str.format template, and the label keys in its order."""
        found = self.templates.get((name, keys))
        if found is None:
            order = tuple(sorted(keys))
            # Escaped names hold no brace (it is no valid character), so they stand in a template.
            labels = ",".join(f'{escape_label_name(key)}="{{}}"' for key in order)
            if self.openmetrics:  # as the library: invalid characters of the name become "_"
                head = _escape(name, UNDERSCORES, _is_legacy_labelname_rune)
            else:
                head = escape_metric_name(name)
            found = (f"{head}{{{{{labels}}}}} " if labels else f"{head} ", order)
            if len(self.templates) >= MOST_TEMPLATES:
                self.templates.clear()
            self.templates[(name, keys)] = found
        return found

    def family(self, family: Metric) -> list[str] | None:
        """The lines of `family`'s samples, or None where a sample needs the library's writer."""
        moved = {family.name + suffix for suffix in MOVED_SUFFIXES}
        lines = []
        for sample in family.samples:
            if (
                sample.timestamp is not None
                or sample.exemplar is not None
                or sample.native_histogram is not None
                or (not self.openmetrics and sample.name in moved)
            ):
                return None
            template, order = self.template(sample.name, tuple(sample.labels))
            labels = sample.labels
            missing = self.openmetrics and sample.value is None
            value = "" if missing else floatToGoString(sample.value)
            values = [labels[key] for key in order]
            if _needs_escapes("".join(values)):
                values = [_escaped(text) for text in values]
            lines.append(template.format(*values) + value)
        return lines


def _header(family: Metric, openmetrics: bool) -> str | None:
    """The HELP and TYPE lines of `family`, or None where it needs the library's writer."""
    if family.type not in TEXT_TYPES or family.unit:
        return None
    if openmetrics:
        name = escape_metric_name(family.name)
        return f"# HELP {name} {_escaped(family.documentation)}\n# TYPE {name} {family.type}\n"
    suffix, written = TEXT_TYPES[family.type]
    name = escape_metric_name(family.name + suffix)
    help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {help_text}\n# TYPE {name} {written}\n"


def generate(families: Iterable[Metric], openmetrics: bool = False) -> bytes:
    """The families in the text format (or OpenMetrics), as prometheus_client's generate_latest."""
    lines = FORMATS[openmetrics]
    output = []
    for family in families:
        TURNS.give_way()
        header = _header(family, openmetrics)
        samples = lines.family(family) if header is not None else None
        if header is None or samples is None:
            output.append(_library(family, openmetrics))
            continue
        output.append(header)
        if samples:
            output.append("\n".join(samples))
            output.append("\n")
    if openmetrics:
        output.append("# EOF\n")
    return "".join(output).encode("utf-8")


FORMATS = {False: _Lines(openmetrics=False), True: _Lines(openmetrics=True)}


def _library(family: Metric, openmetrics: bool) -> str:
    """`family` as prometheus_client writes it (OpenMetrics: without its closing EOF line)."""
    if openmetrics:
        return library_openmetrics(Families([family])).decode("utf-8")[: -len("# EOF\n")]
    return library_text(Families([family])).decode("utf-8")
