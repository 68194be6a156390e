"""Our text and OpenMetrics writer against prometheus_client's own, byte for byte."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.samples import Exemplar, Sample

from kepler_bridge.exposition import prometheus, text_format
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore
from scaffold import make_config

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
# Names a user may configure or a plug-in may give: odd characters the writers must escape alike.
ODD_NAMES = st.text(st.sampled_from("ab_:.-9é{}"), min_size=1, max_size=6)
VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**60), 2**60)
TEXTS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
KINDS = ("counter", "gauge", "info", "unknown")


class Registry:
    """What prometheus_client's writers collect from."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def library(families: list[Metric], openmetrics: bool) -> bytes:
    writer = generate_openmetrics if openmetrics else generate_latest
    return writer(Registry(families))


@st.composite
def family(draw) -> Metric:
    """A family of one of the kinds the writer covers, its labels and values drawn."""
    kind = draw(st.sampled_from(KINDS))
    name = draw(NAMES | ODD_NAMES)
    keys = draw(st.lists(NAMES | ODD_NAMES, max_size=4, unique=True))
    documentation = draw(TEXTS)
    made = {
        "counter": CounterMetricFamily,
        "gauge": GaugeMetricFamily,
        "info": InfoMetricFamily,
        "unknown": UnknownMetricFamily,
    }[kind](name, documentation, labels=keys)
    for _ in range(draw(st.integers(0, 4))):
        labels = [draw(TEXTS) for _ in keys]
        if kind == "info":
            extra = draw(st.dictionaries(NAMES.filter(lambda k: k not in keys), TEXTS, max_size=2))
            made.add_metric(labels, extra)
        elif kind == "counter" and draw(st.booleans()):
            made.add_metric(labels, draw(VALUES), created=draw(st.floats(0, 2e9)))
        else:
            made.add_metric(labels, draw(VALUES))
    return made


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(families=st.lists(family(), max_size=5), openmetrics=st.booleans())
def test_the_writer_gives_the_library_bytes(families: list[Metric], openmetrics: bool) -> None:
    try:
        expected = library(families, openmetrics)
    except (ValueError, TypeError) as refused:  # a name the library will not write
        refused_too = None
        try:
            text_format.generate(families, openmetrics)
        except (ValueError, TypeError) as err:
            refused_too = err
        assert refused_too is not None, refused
        return
    assert text_format.generate(families, openmetrics) == expected


def test_families_it_does_not_cover_go_to_the_library_writer() -> None:
    histogram = HistogramMetricFamily(
        "latency_seconds", "h", buckets=[("0.1", 1), ("+Inf", 2)], sum_value=0.3
    )
    unit = GaugeMetricFamily("size", "with a unit", value=3, unit="bytes")
    stamped = GaugeMetricFamily("stamped", "with a timestamp", labels=["a"])
    stamped.add_metric(["x"], 1.5, timestamp=12.25)
    exemplary = CounterMetricFamily("requests", "with an exemplar")
    exemplary.samples.append(
        Sample("requests_total", {}, 4.0, None, Exemplar({"trace": "t"}, 1.0, None))
    )
    plain = GaugeMetricFamily("plain", "plain", labels=["b"])
    plain.add_metric(['q"\\\n'], math.inf)
    families = [plain, histogram, unit, stamped, exemplary, plain]
    for openmetrics in (False, True):
        assert text_format.generate(families, openmetrics) == library(families, openmetrics)


def test_an_agent_snapshot_renders_as_the_library_writes_it() -> None:
    sampler = Sampler(
        make_config(simulate=3, sources="simulated", kube_source="off"), SnapshotStore()
    )
    try:
        snapshot = sampler.sample()
    finally:
        sampler.stop()
    assert snapshot.gpus and any(gpu.processes for gpu in snapshot.gpus)
    families = list(prometheus.SnapshotCollector(snapshot).collect())
    for openmetrics in (False, True):
        assert text_format.generate(families, openmetrics) == library(families, openmetrics)
