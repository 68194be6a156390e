"""Hostile readings from plug-ins and commands.

/v1/collect stays Go-decodable JSON, /metrics stays parseable.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import operator
import os
import shlex
import sys
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from agent import Agent
from kepler_bridge.exposition import baetyl, prometheus
from kepler_bridge.model import (
    MAX_DEVICES,
    MAX_EXACT,
    CpuTimes,
    GpuProcess,
    GpuReading,
    MigInstance,
    NvLink,
    ProcessCpu,
    RaplZone,
    Snapshot,
    SourceReading,
    replaced,
)
from kepler_bridge.printable import MAX_LABEL_CHARS
from kepler_bridge.sampling import sanitize
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.sampling.slots import Slot, build_slots
from kepler_bridge.sources.base import Source
from kepler_bridge.sources.command import NUMBERS
from kepler_bridge.store import SnapshotStore
from scaffold import make_config, samples

GO_UINT64 = 2**64
# Counters go through the sampler's monotonic guard;
# every other number must arrive as the source gave it.
COUNTERS = {
    "energy_joules",
    "ecc_corrected_total",
    "ecc_uncorrected_total",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "retired_pages_single_bit",
    "retired_pages_double_bit",
    "pcie_replays",
}
NUMERIC = {
    field.name: field.type
    for field in dataclasses.fields(GpuReading)
    if field.type in ("float | None", "int | None")
}
# Readings with a physical range (model.Ratio...): the range of each annotation.
RANGES = {
    "Ratio": (0.0, 1.0),
    "FanRatio": (0.0, 2.0),
    "Celsius": (-55.0, 150.0),
    "Watts": (0.0, 5000.0),
    "Hertz": (1.0, 10e9),
}
RANGED = {f.name: RANGES[f.type] for f in dataclasses.fields(GpuReading) if f.type in RANGES}
# (label, ratio) pairs: each dropped alone when its ratio is unusable.
RATIOS = ("pipe_active", "engine_active")
FLAGS = [field.name for field in dataclasses.fields(GpuReading) if field.type == "bool | None"]

numbers = st.one_of(
    st.none(),
    st.floats(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0.5, 1.5e9, 2**53, 2**64, 1e300]),
)
# Near and across the physical ranges: a percent for a ratio, a cold board, a fan past 100 %.
ranged = numbers | st.sampled_from([-4.5, -56.0, 1.05, 85.0, 150.0, 4000.0, 35_000.0, 0.0, 1.0])
texts = st.text(st.characters(categories=["L", "N", "Cc", "Cs", "P", "Zs"]), max_size=6)


MIG_NUMERIC = {
    field.name: field.type
    for field in dataclasses.fields(MigInstance)
    if field.type in ("float | None", "int | None")
}
MIG_RANGED = {f.name: RANGES[f.type] for f in dataclasses.fields(MigInstance) if f.type in RANGES}


@st.composite
def mig_instances(draw: st.DrawFn) -> MigInstance:
    return MigInstance(
        gpu_instance=draw(numbers),
        compute_instance=draw(numbers),
        uuid=draw(texts),
        profile=draw(texts),
        pids=tuple(draw(st.lists(numbers, max_size=3))),
        **{name: draw(numbers) for name in MIG_NUMERIC},
        **{name: draw(ranged) for name in MIG_RANGED},
    )


@st.composite
def gpus(draw: st.DrawFn, index: int) -> GpuReading:
    processes = draw(
        st.lists(
            st.builds(
                GpuProcess, pid=numbers, comm=texts, memory_used_bytes=numbers, utilization=numbers
            ),
            max_size=3,
        )
    )
    return GpuReading(
        index=index,
        uuid=f"{index}:{draw(texts)}",
        vendor=draw(texts),
        model=draw(texts),
        up=draw(st.booleans()),
        error=draw(texts),
        processes=tuple(processes),
        throttled=tuple(draw(st.lists(st.tuples(texts, st.booleans()), max_size=2))),
        xid_errors=tuple(
            draw(st.lists(st.tuples(numbers | st.just("other"), numbers), max_size=3))
        ),
        **{name: tuple(draw(st.lists(st.tuples(texts, numbers), max_size=2))) for name in RATIOS},
        nvlinks=tuple(
            draw(
                st.lists(
                    st.builds(
                        NvLink,
                        link=numbers,
                        up=st.booleans(),
                        transmit_bytes=numbers,
                        receive_bytes=numbers,
                        errors=st.lists(st.tuples(texts, numbers), max_size=2).map(tuple),
                    ),
                    max_size=2,
                )
            )
        ),
        clock_event_seconds=tuple(draw(st.lists(st.tuples(texts, numbers), max_size=2))),
        mig_instances=tuple(draw(st.lists(mig_instances(), max_size=2))),
        **{name: draw(st.none() | st.booleans() | numbers) for name in FLAGS},
        **{name: draw(numbers) for name in NUMERIC},
        **{name: draw(ranged) for name in RANGED},
    )


@st.composite
def readings(draw: st.DrawFn) -> SourceReading:
    count = draw(st.integers(min_value=0, max_value=3))
    return SourceReading(
        gpus=tuple(draw(gpus(index)) for index in range(count)),
        processes=tuple(
            draw(
                st.lists(
                    st.builds(
                        ProcessCpu, pid=numbers, comm=texts, cpu_seconds=numbers, container_id=texts
                    ),
                    max_size=3,
                )
            )
        ),
        rapl_zones=tuple(
            draw(
                st.lists(
                    st.builds(
                        RaplZone,
                        id=texts,
                        zone=st.sampled_from(["package", "dram"]),
                        energy_uj=numbers,
                        max_energy_range_uj=numbers,
                    ),
                    max_size=2,
                )
            )
        ),
        cpu_times=draw(
            st.none() | st.builds(CpuTimes, busy_seconds=numbers, total_seconds=numbers)
        ),
        ebpf_programs_attached=draw(numbers),
    )


class Replay(Source):
    """A plug-in source returning the readings it is given, one per read."""

    name = "replay"

    def __init__(self, readings: list[Any]) -> None:
        super().__init__(make_config())
        self.readings = readings

    def start(self) -> None:
        pass

    def read(self) -> SourceReading:
        return self.readings.pop(0)


def sampler(*slots: Slot, **settings: str) -> Sampler:
    settings = {
        "sources": "simulated",
        "kube_source": "off",
        "pod_resources_socket": "",
        **settings,
    }
    return Sampler(make_config(**settings), SnapshotStore(), list(slots) or None)


def assert_exportable(collect: bytes, metrics: str) -> None:
    """What Go's encoding/json (uint64 fields) and Prometheus accept.

    No NaN or Inf, whole numbers as integers."""

    def no_constants(token: str) -> None:
        raise AssertionError(f"/v1/collect holds {token}")

    (node,) = json.loads(collect, parse_constant=no_constants).values()
    for entry in (node, *node["devices"]):
        for key in ("usedMemory", "totalMemory") + (("deviceNum",) if entry is node else ()):
            assert type(entry[key]) is int and 0 <= entry[key] < GO_UINT64, (key, entry[key])
        assert 0 <= entry["percent"] <= 1
    values = [sample.value for sample in samples(metrics)]
    assert values and all(math.isfinite(value) for value in values)


def expected(raw: Any, whole: bool) -> float | int | None:
    """The rule: a usable number as it is (bytes and counts rounded down), else not reported."""
    usable = (
        isinstance(raw, (int, float))
        and not isinstance(raw, bool)
        and not math.isnan(raw)
        and 0 <= raw < MAX_EXACT
    )
    return (math.floor(raw) if whole else raw) if usable else None


def within(raw: Any, low: float, high: float) -> float | None:
    """The rule of a reading with a physical range: a number in it as a float, else dropped."""
    usable = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    return float(raw) if usable and low <= raw <= high else None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=readings(), second=readings())
def test_hostile_plugin_readings_reach_the_exporters_clean(
    first: SourceReading, second: SourceReading
) -> None:
    agent = sampler(Slot("replay", Replay([first, second]), started=True))
    for raw in (first, second):
        snapshot = agent.sample()
        assert snapshot.sources[0].up, snapshot.sources[0].error
        assert_exportable(baetyl.render(snapshot), render(snapshot))
        arrived = {gpu.uuid.partition(":")[0]: gpu for gpu in snapshot.gpus}
        assert len(arrived) == len(raw.gpus)
        for given_gpu in raw.gpus:
            gpu = arrived[str(given_gpu.index)]
            for name, kind in NUMERIC.items():
                if name not in COUNTERS:
                    assert getattr(gpu, name) == expected(
                        getattr(given_gpu, name), kind == "int | None"
                    ), name
            for name, (low, high) in RANGED.items():
                assert getattr(gpu, name) == within(getattr(given_gpu, name), low, high), name
            for name in RATIOS:
                assert [value for _, value in getattr(gpu, name)] == [
                    expected(value, False)
                    for _, value in getattr(given_gpu, name)
                    if expected(value, False) is not None
                ], name
            for name in FLAGS:
                flag = getattr(given_gpu, name)
                assert getattr(gpu, name) is (flag if isinstance(flag, bool) else None), name
            assert [link.link for link in gpu.nvlinks] == [
                math.floor(link.link)
                for link in given_gpu.nvlinks
                if expected(link.link, whole=True) is not None
            ]
            assert_mig_clean(given_gpu.mig_instances, gpu.mig_instances)


def assert_mig_clean(given: tuple[MigInstance, ...], arrived: tuple[MigInstance, ...]) -> None:
    """A MIG device without usable instance ids is dropped; the others keep usable values only."""
    kept = [
        mig
        for mig in given
        if expected(mig.gpu_instance, whole=True) is not None
        and expected(mig.compute_instance, whole=True) is not None
    ]
    assert len(arrived) == len(kept)
    for raw, mig in zip(kept, arrived):
        assert (mig.gpu_instance, mig.compute_instance) == (
            math.floor(raw.gpu_instance),
            math.floor(raw.compute_instance),
        )
        for name, kind in MIG_NUMERIC.items():
            assert getattr(mig, name) == expected(getattr(raw, name), kind == "int | None"), name
        for name, (low, high) in MIG_RANGED.items():
            assert getattr(mig, name) == within(getattr(raw, name), low, high), name
        assert list(mig.pids) == [
            math.floor(pid) for pid in raw.pids if expected(pid, whole=True) is not None
        ]


def render(snapshot: Snapshot) -> str:
    return prometheus.render(snapshot, lambda name: True).decode()


def test_a_plugins_readings_outside_their_physical_range_are_dropped() -> None:
    """A plug-in gives a percent where a ratio belongs, or a garbage temperature, power or clock:
    dropped as the built-in sources drop them; a cold board and a fan past 100 % are kept."""
    raw = GpuReading(
        index=0, uuid="P-0", vendor="acme", model="npu", utilization=85.0,
        temperature_celsius=4000.0, power_watts=35_000.0, sm_clock_hertz=0.0,
        memory_temperature_celsius=-4.5, fan_speed_ratio=1.05,
        processes=(GpuProcess(7, utilization=60.0), GpuProcess(8, utilization=0.6)),
    )  # fmt: skip
    agent = sampler(Slot("replay", Replay([SourceReading(gpus=(raw,))]), started=True))
    (gpu,) = agent.sample().gpus
    assert (gpu.utilization, gpu.temperature_celsius, gpu.power_watts, gpu.sm_clock_hertz) == (
        None,
        None,
        None,
        None,
    )
    assert (gpu.memory_temperature_celsius, gpu.fan_speed_ratio) == (-4.5, 1.05)
    assert [process.utilization for process in gpu.processes] == [None, 0.6]


def test_a_pid_a_plugin_lists_twice_on_a_device_is_one_process_its_first_row() -> None:
    """Two rows of one pid would be two series of one name and labels (a scrape refuses them)
    and two shares of the device's energy; on another device the pid is its own row."""
    twice = (GpuProcess(7, "a", 1 << 20, 0.25), GpuProcess(8), GpuProcess(7, "a", 1 << 21, 0.5))
    raw = SourceReading(
        gpus=(
            GpuReading(index=0, uuid="P-0", vendor="acme", model="npu", processes=twice),
            GpuReading(index=1, uuid="P-1", vendor="acme", model="npu", processes=twice[:1]),
        )
    )
    agent = sampler(Slot("replay", Replay([raw]), started=True))
    first, second = agent.sample().gpus
    kept = [(row.pid, row.memory_used_bytes) for row in first.processes]
    assert kept == [(7, 1 << 20), (8, None)]
    assert [row.pid for row in second.processes] == [7]


def test_a_source_reporting_more_than_max_devices_is_down_with_the_reason() -> None:
    many = SourceReading(
        gpus=tuple(
            GpuReading(index=i, uuid=f"u{i}", vendor="acme", model="x")
            for i in range(MAX_DEVICES + 1)
        )
    )
    enough = SourceReading(gpus=many.gpus[:MAX_DEVICES])
    agent = sampler(Slot("replay", Replay([enough, many, "not a reading"]), started=True))
    assert len(agent.sample().gpus) == MAX_DEVICES
    down = agent.sample()
    assert (
        not down.sources[0].up
        and f"257 devices, more than {MAX_DEVICES} per source" in down.sources[0].error
    )
    assert len(down.gpus) == MAX_DEVICES and not any(
        gpu.up for gpu in down.gpus
    )  # the last good ones, down
    wrong = agent.sample()
    assert "read() returned str, not a SourceReading" in wrong.sources[0].error


def rule_by_rule(raw: SourceReading) -> SourceReading:
    """What the sanitiser gives with every rule run on every value of every record, the checks of
    many records at once left out."""
    with mock.patch.object(sanitize, "_records", sanitize._one_by_one):
        return sanitize.reading(raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=readings())
def test_the_checks_of_many_records_keep_what_the_rules_keep(raw: SourceReading) -> None:
    clean = sanitize.reading(raw)
    assert clean == rule_by_rule(raw)
    assert sanitize.reading(clean) == clean == rule_by_rule(clean)


def test_text_longer_than_any_label_is_cut() -> None:
    """A plug-in printing a new megabyte uuid each sample made the agent hold 256 of them (the
    absent devices it remembers, their counters, the state file): text is cut at MAX_LABEL_CHARS,
    by the fast check and by the rules alike."""
    long = "GPU-" + "x" * (2 * MAX_LABEL_CHARS)
    raw = SourceReading(
        gpus=(GpuReading(0, long, "acme", long, processes=(GpuProcess(7, long),)),),
        processes=(ProcessCpu(7, long, 1.0),),
    )
    clean = sanitize.reading(raw)
    assert clean == rule_by_rule(raw)
    (gpu,), (process,) = clean.gpus, clean.processes
    texts = (gpu.uuid, gpu.model, gpu.processes[0].comm, process.comm)
    assert [len(text) for text in texts] == [MAX_LABEL_CHARS] * 4
    assert sanitize.reading(clean) is clean


def test_a_clean_reading_passes_as_the_very_object() -> None:
    """The fast path: a reading whose every value its rule keeps is not copied."""
    (slot,) = [
        slot for slot in build_slots(make_config(simulate=2, sources="simulated")) if slot.started
    ]
    assert slot.source is not None
    raw = slot.source.read()
    assert raw.gpus and raw.gpus[0].processes
    assert sanitize.reading(raw) is raw
    assert sanitize.reading(replaced(raw, gpus=raw.gpus[::-1])).gpus[0] is raw.gpus[-1]


def test_rows_known_clean_do_not_let_a_new_bad_row_through() -> None:
    """Rows a source keeps from one sample to the next are known clean by identity; a new row,
    even one equal in labels to a known one or in the place of a freed one, is checked."""
    rows = tuple(ProcessCpu(pid, f"p{pid}", 1.0 + pid) for pid in range(1, 50))
    for _ in range(3):
        assert sanitize.reading(SourceReading(processes=rows)).processes == rows
    bad = (ProcessCpu(1, "p1", math.nan), ProcessCpu(2, "p\x1b[2J2", 3.0), ProcessCpu(-3, "x", 1.0))
    cleaned = sanitize.reading(SourceReading(processes=rows + bad)).processes
    assert cleaned[: len(rows)] == rows and all(map(operator.is_, cleaned, rows))
    assert cleaned[len(rows) :] == (ProcessCpu(2, "p2", 3.0),)
    gpu = GpuReading(index=0, uuid="u", vendor="acme", model="x", processes=(GpuProcess(7, "a"),))
    assert sanitize.reading(SourceReading(gpus=(gpu,))).gpus[0] is gpu
    for _ in range(20):  # new rows in the memory of freed ones, their ids too
        clean = [ProcessCpu(pid, "q", 1.0) for pid in range(1, 50)]
        sanitize.reading(SourceReading(processes=tuple(clean)))
        del clean
        dirty = tuple(ProcessCpu(pid, "q", -1.0) for pid in range(1, 50))
        assert sanitize.reading(SourceReading(processes=dirty)).processes == ()
        again = replaced(gpu, processes=(GpuProcess(7, "a", utilization=math.inf),))
        assert sanitize.reading(SourceReading(gpus=(again,))).gpus[0].processes == (
            GpuProcess(7, "a"),
        )


def test_rows_that_move_or_are_replaced_in_place_are_told_apart() -> None:
    """Known rows are compared where they stood: a row dropped from the middle shifts the others,
    which stay known (the very objects); a bad row in the place of a known one is cleaned."""
    rows = [ProcessCpu(pid, f"p{pid}", 1.0 + pid) for pid in range(1, 40)]
    assert sanitize.reading(SourceReading(processes=tuple(rows))).processes == tuple(rows)
    del rows[10]
    shifted = sanitize.reading(SourceReading(processes=tuple(rows))).processes
    assert all(map(operator.is_, shifted, rows)) and len(shifted) == len(rows)
    for place in (0, 20, len(rows) - 1):
        swapped = list(rows)
        swapped[place] = ProcessCpu(rows[place].pid, "bad\x07", -1.0)
        cleaned = sanitize.reading(SourceReading(processes=tuple(swapped))).processes
        assert cleaned == tuple(rows[:place] + rows[place + 1 :])
        assert sanitize.reading(SourceReading(processes=tuple(rows))).processes == tuple(rows)


def test_rows_no_longer_reported_are_let_go() -> None:
    """What the sanitiser remembers of rows is bounded: an exited process's row is freed."""
    gone = ProcessCpu(1, "exited", 5.0)
    assert sanitize.reading(SourceReading(processes=(gone,))).processes == (gone,)
    freed = weakref.ref(gone)
    del gone
    for sample in range(100):  # the rows of a host whose processes change every sample
        rows = tuple(ProcessCpu(pid, "busy", float(sample)) for pid in range(2, 200))
        sanitize.reading(SourceReading(processes=rows))
    assert freed() is None


def test_gpu_process_rows_are_known_clean_and_let_go_like_cpu_rows() -> None:
    """The nvml source hands the sanitiser the last read's GPU process rows where their values did
    not change: those are known by identity, a new bad row is still cleaned, and the row of an
    exited process is freed."""

    def reading(rows: tuple[GpuProcess, ...]) -> SourceReading:
        gpu = GpuReading(index=0, uuid="u", vendor="acme", model="x", processes=rows)
        return SourceReading(gpus=(gpu,))

    rows = tuple(GpuProcess(pid, f"p{pid}", 2**30 + pid, 0.5) for pid in range(1, 50))
    for _ in range(3):
        assert sanitize.reading(reading(rows)).gpus[0].processes == rows
    bad = (GpuProcess(100, "p1", -1, 0.5), GpuProcess(101, "p\x1b[2J2", utilization=math.nan))
    cleaned = sanitize.reading(reading(rows + bad)).gpus[0].processes
    assert cleaned[: len(rows)] == rows and all(map(operator.is_, cleaned, rows))
    assert cleaned[len(rows) :] == (GpuProcess(100, "p1", None, 0.5), GpuProcess(101, "p2"))
    freed = weakref.ref(rows[0])
    del rows, cleaned
    for sample in range(100):  # rows that change every sample
        sanitize.reading(reading(tuple(GpuProcess(pid, "busy", sample) for pid in range(2, 200))))
    assert freed() is None


def test_the_sanitiser_holds_no_row_older_than_the_last_reading() -> None:
    """Known rows are those of the last reading: a row a source replaced (its counter moved) or
    dropped is freed once a later reading is checked, so a busy host's stale rows are not kept."""
    kept = tuple(ProcessCpu(pid, "idle", 1.0) for pid in range(2, 100))
    earlier = []
    for sample in range(10):
        busy = tuple(ProcessCpu(pid, "busy", float(sample)) for pid in range(100, 300))
        sanitize.reading(SourceReading(processes=kept + busy))
        earlier += map(weakref.ref, busy)
        del busy
    gc.collect()
    alive = sum(row() is not None for row in earlier[:-200])
    assert alive == 0, f"{alive} rows of earlier readings still held"


def test_tuples_known_clean_do_not_let_a_new_bad_tuple_through() -> None:
    """The tuple fields a source hands again (the same clocks event reasons, slow counters carried
    between reads) are known clean by identity; a new tuple, even one in the memory of a freed
    known one, is checked; and a known tuple is let go once a later reading brings new ones."""
    reasons = (("gpu_idle", True), ("hw_slowdown", False))
    gpu = GpuReading(index=0, uuid="u", vendor="acme", model="x", throttled=reasons)
    for _ in range(3):
        assert sanitize.reading(SourceReading(gpus=(gpu,))).gpus[0] is gpu
    for count in range(20):  # new tuples in the memory of freed ones, their ids too
        clean = tuple((f"reason{n}", True) for n in range(count % 4 + 1))
        events = tuple((f"policy{n}", float(n)) for n in range(count % 3 + 1))
        read = sanitize.reading(
            SourceReading(gpus=(replaced(gpu, throttled=clean, clock_event_seconds=events),))
        )
        assert read.gpus[0].throttled is clean and read.gpus[0].clock_event_seconds is events
        del clean, events, read
        dirty = tuple((f"reason{n}\x1b[2J", n) for n in range(count % 4 + 1))
        nan = tuple((f"policy{n}", math.nan) for n in range(count % 3 + 1))
        read = sanitize.reading(
            SourceReading(gpus=(replaced(gpu, throttled=dirty, clock_event_seconds=nan),))
        )
        assert read.gpus[0].throttled == tuple(
            (f"reason{n}", bool(n)) for n in range(count % 4 + 1)
        )
        assert read.gpus[0].clock_event_seconds == ()
    sanitize.reading(SourceReading(gpus=(gpu,)))
    held = sys.getrefcount(reasons)
    sanitize.reading(SourceReading(gpus=(replaced(gpu, throttled=(("hw_slowdown", True),)),)))
    assert sys.getrefcount(reasons) == held - 1


# JSON number tokens a collector may print, Python's NaN and Infinity extensions included.
TOKENS = st.one_of(
    st.just("null"),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0.0", "1.5e9", "0.5", "2e19"]),
)


@st.composite
def command_outputs(draw: st.DrawFn) -> str:
    devices = [
        ", ".join(
            [f'"uuid": "C-{index}\\ud800"']
            + [
                f'"{key}": {draw(TOKENS)}'
                for key in draw(st.lists(st.sampled_from(sorted(NUMBERS))))
            ]
        )
        for index in range(draw(st.integers(min_value=0, max_value=3)))
    ]
    return '{"devices": [%s]}' % ", ".join("{%s}" % device for device in devices)


def test_hostile_command_output_reaches_the_exporters_clean(tmp_path: Path) -> None:
    output = tmp_path / "output.json"
    output.write_text('{"devices": []}')
    agent = sampler(sources="command", command=shlex.join(["cat", str(output)]))

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=command_outputs())
    def check(text: str) -> None:
        output.write_text(text)
        snapshot = agent.sample()
        assert [(status.name, status.up) for status in snapshot.sources] == [("command", True)], (
            snapshot.sources
        )
        assert_exportable(baetyl.render(snapshot), render(snapshot))

    check()


# A plug-in package (entry point in group kepler_bridge.sources)
# whose readings are what the test writes.
PLUGIN = """
import json, os
from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources.base import Source

class Written(Source):
    name = "written"
    def start(self):
        pass
    def read(self):
        with open(os.environ["KB_TEST_READINGS"]) as file:
            return SourceReading(gpus=tuple(GpuReading(**gpu) for gpu in json.load(file)))
"""


def plugin_site(root: Path) -> Path:
    info = root / "kb_written-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kb-written\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kepler_bridge.sources]\nwritten = kb_written:Written\n"
    )
    (root / "kb_written.py").write_text(PLUGIN)
    return root


def replace_file(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def devices_tagged(metrics: str, tag: str) -> list[str]:
    return [
        sample.labels["uuid"]
        for sample in samples(metrics, "gpu_info")
        if sample.labels["uuid"].startswith(f"{tag}-")
    ]


@pytest.mark.e2e
def test_hostile_readings_through_the_real_http_server(tmp_path: Path) -> None:
    readings, output = tmp_path / "readings.json", tmp_path / "output.json"
    replace_file(readings, "[]")
    replace_file(output, '{"devices": null}')
    env = {"PYTHONPATH": str(plugin_site(tmp_path / "site")), "KB_TEST_READINGS": str(readings)}
    with Agent(
        "--sources",
        "written",
        "--command",
        shlex.join(["cat", str(output)]),
        "--interval",
        "0.1s",
        env=env,
    ) as agent:
        serial = iter(range(1_000_000))

        @settings(
            max_examples=12,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.reuse, Phase.generate),
        )  # shrinking would wait on the agent
        @given(
            devices=st.lists(
                st.fixed_dictionaries({name: numbers for name in NUMERIC}), max_size=2
            ),
            text=command_outputs(),
        )
        def check(devices: list[dict[str, Any]], text: str) -> None:
            tag = f"P-{next(serial)}"
            plugin = [
                {"index": i, "uuid": f"{tag}-{i}", "vendor": "acme", "model": "m", **device}
                for i, device in enumerate(devices + [{}])
            ]
            replace_file(readings, json.dumps(plugin))
            replace_file(output, text.replace('"C-', f'"{tag}-C-'))
            agent.wait_for(
                lambda: (
                    len(devices_tagged(agent.metrics(), tag)) == len(plugin) + text.count('"C-')
                ),
                what=f"readings {tag}",
            )
            collect = agent.get("/v1/collect")
            assert collect.status_code == 200
            assert_exportable(collect.content, agent.metrics())

        check()
