"""Energy attribution: conservation and monotonicity over random sequences (hypothesis), and its
rules one by one."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kepler_bridge.model import (
    NO_POD,
    CpuTimes,
    Energy,
    GpuProcess,
    GpuReading,
    Holder,
    PodRef,
    ProcessCpu,
    RaplZone,
    SourceReading,
    replaced,
)
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.attribution import Attribution, SampleInputs
from kepler_bridge.sampling.counters import MonotonicCounters
from kepler_bridge.sampling.device_index import MAX_ABSENT, DeviceIndexes
from kepler_bridge.sampling.gpu_energy import gpu_shares
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore
from scaffold import make_config

T = TypeVar("T", Attribution, MonotonicCounters)
REAL_MAX_UJ = 262143328850
PODS = {
    "c1": PodRef("shop", "web-1", "nginx"),
    "c2": PodRef("shop", "web-1", "sidecar"),
    "c3": PodRef("ml", "train-0", "main"),
}
# Process slots: pid, comm, container id ("c4" is a container no pod list names).
SLOTS = [(100 + i, f"p{i}", cid) for i, cid in enumerate(["", "c1", "c2", "c3", "c4", ""])]


def gpu(uuid: str, **values) -> GpuReading:
    return GpuReading(index=0, uuid=uuid, vendor="nvidia", model="A100", **values)


def owners(cpu_increases: dict[tuple, float]) -> dict[tuple, PodRef]:
    """Each process's container, as the sampler joins it from the pod list."""
    return {key: PODS.get(key[2], NO_POD) for key in cpu_increases}


def holders(*owners: PodRef, pods: dict[str, PodRef] = PODS) -> tuple[Holder, ...]:
    """A device's holders, as the sampler joins them: each with its container id where the pod list
    names it."""
    ids = {owner: container_id for container_id, owner in pods.items()}
    return tuple(Holder(ids.get(owner, ""), owner) for owner in owners)


def identities(energy: Energy) -> dict[tuple, float]:
    """Every counter of an output by the series it would be exported as."""
    found: dict[tuple, float] = {}
    for zone in energy.cpu_zones:
        found[("zone", zone.zone, zone.source)] = zone.joules
    for uuid, joules in energy.gpu_idle:
        found[("idle", uuid)] = joules
    for uuid, reason, joules in energy.gpu_unattributed:
        found[("unattributed", uuid, reason)] = joules
    for level, kind, rows in (
        ("process", "cpu", energy.cpu_processes),
        ("process", "gpu", energy.gpu_processes),
        ("container", "cpu", energy.containers),
        ("container", "gpu", energy.containers),
        ("pod", "cpu", energy.pods),
        ("pod", "gpu", energy.pods),
    ):
        for row in rows:
            labels = (
                row.pid,
                row.comm,
                row.container_id,
                row.owner.namespace,
                row.owner.pod,
                row.owner.container,
            )
            found[(level, kind) + labels] = getattr(row, f"{kind}_joules")
    return found


def increases(
    before: dict[tuple, float], after: dict[tuple, float], level: str, kind: str
) -> float:
    """Sum over one level's series of what they gained; a new series counts from zero."""
    return sum(
        value - before.get(key, 0.0) for key, value in after.items() if key[:2] == (level, kind)
    )


def carried(old: T, new: T) -> T:
    """`new` (made with `old`'s settings) given `old`'s state through JSON, as a new worker gets
    it from the state file (`carry.encode` writes it); that state must come back whole."""
    saved = json.loads(carry.encode(old.state()))
    new.restore(saved)
    assert json.loads(carry.encode(new.state())) == saved
    return new


def assert_monotonic(before: dict[tuple, float], after: dict[tuple, float]) -> None:
    for key, value in after.items():
        if key in before:
            assert value >= before[key], (key, before[key], value)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_conservation_and_monotonicity_over_random_sequences(data: st.DataObject) -> None:
    draw = data.draw
    ncpu = draw(st.integers(1, 64), label="cpus")
    wrap_max = draw(st.integers(1_000_000, 10**9), label="max_energy_range_uj of zone 0")
    raw = {
        "intel-rapl:0": draw(st.integers(0, wrap_max - 1)),
        "intel-rapl:1": draw(st.integers(0, 10**9)),
    }
    maxes = {"intel-rapl:0": wrap_max, "intel-rapl:1": REAL_MAX_UJ}
    idle_watts = draw(st.none() | st.floats(0, 300), label="gpu_idle_watts")
    limit = draw(st.integers(1, 4), label="top")
    counter_gpu = draw(st.booleans(), label="GPU-0 has an energy counter")
    counters = MonotonicCounters()
    full = Attribution(gpu_idle_watts=idle_watts, process_limit=None, grace=1e9)
    top = Attribution(gpu_idle_watts=idle_watts, process_limit=limit, grace=1e9)
    cpu = {slot: 0.0 for slot in SLOTS}
    seen_before: set = set()  # a process left out of a sample counts on from where it was
    busy = total = 0.0
    gpu_raw, gpu_raw_at_last_up = draw(st.floats(0, 1e6)), None
    now = 0.0
    previous_full = previous_top = {}
    for step in range(draw(st.integers(2, 16), label="samples")):
        dt = draw(st.floats(0.05, 5.0), label="interval")
        now += dt
        # RAPL: zone 0 wraps at its small range, zone 1 may be reset (a "wrap" would mean > 200 kJ).
        package_joules = 0.0
        for zone_id in raw:
            if zone_id == "intel-rapl:1" and raw[zone_id] and draw(st.integers(0, 9)) == 0:
                raw[zone_id] = added = draw(
                    st.integers(0, raw[zone_id] - 1)
                )  # reset: known energy is what it holds
            else:
                added = min(int(draw(st.floats(0, 400)) * dt * 1e6), maxes[zone_id] - 1)
                raw[zone_id] = (raw[zone_id] + added) % maxes[zone_id]
            package_joules += added / 1e6
        zones = tuple(
            RaplZone(zone_id, "package", value, maxes[zone_id]) for zone_id, value in raw.items()
        )
        usage = draw(st.floats(0, 1), label="usage")
        busy, total = busy + usage * ncpu * dt, total + ncpu * dt
        # Processes: come and go, restart (counter from a small value), use 0..2 CPUs.
        rows, expected_cpu = [], {}
        for slot in SLOTS:
            if not draw(st.integers(0, 4)):
                continue
            old = cpu[slot]
            if draw(st.integers(0, 9)) == 0:
                cpu[slot] = draw(
                    st.floats(0, dt)
                )  # a new process with the same pid, comm and container
            else:
                cpu[slot] += draw(st.floats(0, 2 * dt))
            known = slot in seen_before and cpu[slot] >= old
            expected_cpu[slot] = cpu[slot] - old if known else cpu[slot]
            rows.append(ProcessCpu(slot[0], slot[1], cpu[slot], slot[2]))
        seen_before |= {(row.pid, row.comm, row.container_id) for row in rows}
        cpu_increases = counters.cpu_increases(rows)
        assert cpu_increases == pytest.approx(expected_cpu)
        # One GPU: lost now and then, reset now and then, 0..3 processes with or without
        # SM utilization.
        up = draw(st.integers(0, 4)) > 0
        watts = draw(st.floats(0, 700))
        gpu_raw += watts * dt
        gpu_joules = 0.0
        if up and counter_gpu:
            if draw(st.integers(0, 9)) == 0:
                gpu_raw = draw(st.floats(0, 100))  # GPU reset: its counter starts again
            if gpu_raw_at_last_up is not None:
                gpu_joules = (
                    gpu_raw - gpu_raw_at_last_up if gpu_raw >= gpu_raw_at_last_up else gpu_raw
                )
            gpu_raw_at_last_up = gpu_raw
        elif up and step:
            gpu_joules = watts * dt
        processes = tuple(
            GpuProcess(
                pid,
                comm,
                utilization=draw(st.none() | st.floats(0, 1)),
                container_id=cid,
                owner=PODS.get(cid, NO_POD),
            )
            for pid, comm, cid in draw(
                st.lists(
                    st.sampled_from(SLOTS + [(900, "", ""), (901, "", "")]), max_size=3, unique=True
                )
            )
        )
        reading = counters.gpu(
            gpu(
                "GPU-0",
                up=up,
                processes=processes,
                power_watts=watts,
                energy_joules=gpu_raw if counter_gpu else None,
            ),
            now,
        )
        inputs = SampleInputs(
            now, zones, CpuTimes(busy, total), (reading,), cpu_increases, owners(cpu_increases)
        )
        after_full, after_top = identities(full.update(inputs)), identities(top.update(inputs))

        for before, after in ((previous_full, after_full), (previous_top, after_top)):
            assert_monotonic(before, after)
            assert all(value >= 0 for value in after.values())
        # A process has a GPU series once it has GPU energy, and keeps it (grace 1e9: it lives).
        gpu_series = {key for key in after_full if key[:2] == ("process", "gpu")}
        assert all(after_full[key] > 0 for key in gpu_series)
        assert {key for key in previous_full if key[:2] == ("process", "gpu")} <= gpu_series
        if step:
            active = (
                package_joules * usage
                if any(value > 0 for value in cpu_increases.values())
                else 0.0
            )
            for before, after in ((previous_full, after_full), (previous_top, after_top)):
                assert increases(before, after, "process", "cpu") == pytest.approx(
                    active, rel=0.01, abs=1e-6
                )
                gpu_total = (
                    increases(before, after, "process", "gpu")
                    + after.get(("idle", "GPU-0"), 0.0)
                    - before.get(("idle", "GPU-0"), 0.0)
                )
                assert gpu_total == pytest.approx(gpu_joules, rel=1e-6, abs=1e-6)
                for kind in ("cpu", "gpu"):
                    attributed = increases(before, after, "process", kind)
                    assert increases(before, after, "container", kind) == pytest.approx(
                        attributed, abs=1e-6
                    )
                    assert increases(before, after, "pod", kind) == pytest.approx(
                        attributed, abs=1e-6
                    )
            zone_gain = after_full[("zone", "package", "rapl")] - previous_full.get(
                ("zone", "package", "rapl"), 0
            )
            assert zone_gain == pytest.approx(package_joules, rel=1e-6, abs=1e-6)
            if not processes and up:
                assert increases(previous_full, after_full, "process", "gpu") == 0
        for kind in ("cpu", "gpu"):
            shown = [key for key in after_top if key[:2] == ("process", kind) and key[2] != "other"]
            assert len(shown) <= limit
        previous_full, previous_top = after_full, after_top
        if draw(st.integers(0, 3), label="a new worker takes over") == 0:
            counters = carried(counters, MonotonicCounters())
            full = carried(
                full, Attribution(gpu_idle_watts=idle_watts, process_limit=None, grace=1e9)
            )
            top = carried(
                top, Attribution(gpu_idle_watts=idle_watts, process_limit=limit, grace=1e9)
            )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_new_worker_continues_exactly_where_the_old_one_was(data: st.DataObject) -> None:
    """Counters and attribution carried through the state file at any sample give, from there on,
    every output the ones that kept running give; samples often repeat the last one's processes
    (the sampler's fast path) and are sometimes empty."""
    draw = data.draw
    limit = draw(st.sampled_from([None, 1, 3]), label="top")
    grace = draw(st.sampled_from([0.0, 2.0, 1e9]), label="grace")
    made = lambda: (  # noqa: E731
        MonotonicCounters(limit),
        Attribution(gpu_idle_watts=0.0, process_limit=limit, grace=grace, max_processes=4),
    )
    kept, moved = made(), made()
    cpu = {slot: 0.0 for slot in SLOTS}
    present = list(SLOTS[:3])
    for step in range(draw(st.integers(2, 12), label="samples")):
        if draw(st.integers(0, 2)) == 0:  # else the same processes, in the same order
            present = draw(st.lists(st.sampled_from(SLOTS), unique=True, max_size=6))
        for slot in present:
            cpu[slot] += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0]))
        rows = [ProcessCpu(pid, comm, cpu[(pid, comm, cid)], cid) for pid, comm, cid in present]
        on_gpu = tuple(
            GpuProcess(pid, comm, utilization=0.5, container_id=cid, owner=PODS.get(cid, NO_POD))
            for pid, comm, cid in present[: draw(st.integers(0, 2))]
        )
        reading = gpu("GPU-0", energy_joules=100.0 * step, processes=on_gpu)
        outputs = []
        for counters, attribution in (kept, moved):
            increases = counters.cpu_increases(rows)
            shown = counters.process_seconds(increases), counters.containers(increases)
            inputs = SampleInputs(
                float(step),
                (RaplZone("intel-rapl:0", "package", step * 10_000_000, REAL_MAX_UJ),),
                CpuTimes(step, 2.0 * step),
                (counters.gpu(reading, float(step)),),
                increases,
                owners(increases),
            )
            outputs.append((shown, attribution.update(inputs)))
        assert outputs[0] == outputs[1], f"sample {step}"
        if draw(st.booleans(), label="a new worker takes over"):
            moved = (carried(moved[0], made()[0]), carried(moved[1], made()[1]))


def test_a_process_that_execs_or_moves_counts_its_seconds_once() -> None:
    counters = MonotonicCounters()
    samples = [
        ([(7, "sh", "", 1.5), (8, "kworker/0:1-events", "", 9.0)], {7: 1.5, 8: 9.0}),
        ([(7, "python", "", 2.0), (8, "kworker/0:1-mm_percpu_wq", "", 9.0)], {7: 0.5, 8: 0.0}),
        ([(7, "python", "c1", 2.25), (8, "kworker/0:1-events", "", 9.5)], {7: 0.25, 8: 0.5}),
        # A new process on pid 7 (its counter below the last one's): it counts whole.
        ([(7, "worker", "c1", 0.25), (8, "kworker/0:1-events", "", 9.5)], {7: 0.25, 8: 0.0}),
    ]
    for at, (rows, expected) in enumerate(samples):
        increases = counters.cpu_increases([ProcessCpu(p, c, s, cid) for p, c, cid, s in rows])
        assert {key[0]: seconds for key, seconds in increases.items()} == expected, at


def test_a_pid_taken_again_under_the_same_labels_counts_from_its_own_start() -> None:
    """Another process on a pid (its start changed) with the same comm and container counts whole,
    even with more seconds than the one before had; that one keeps what it counted. So for rows
    kept by the source (eBPF, procfs) and rows made afresh, and after an exec."""
    for fresh in (False, True):
        counters = MonotonicCounters()
        first = [ProcessCpu(pid, "job", 2.0, "x", start=10) for pid in (1, 2, 3, 4)]
        assert sum(counters.cpu_increases(first).values()) == 8.0
        again = [ProcessCpu(1, "job", 3.0, "x", start=90), *first[1:]]
        if fresh:
            again = [dataclasses.replace(row) for row in again]
        increases = counters.cpu_increases(again)
        assert increases[(1, "job", "x")] == 3.0, f"fresh rows: {fresh}"
        assert sum(increases.values()) == 3.0
    counters = MonotonicCounters()
    counters.cpu_increases([ProcessCpu(7, "sh", 1.0, "", start=5)])
    # Pid 7 gone under "sh" and shown under "python": an exec counts on, another process whole.
    exec_ = counters.cpu_increases([ProcessCpu(7, "python", 1.5, "", start=5)])
    other = counters.cpu_increases([ProcessCpu(7, "sh", 2.5, "", start=8)])
    assert (exec_[(7, "python", "")], other[(7, "sh", "")]) == (0.5, 2.5)


def test_a_process_left_out_and_back_counts_what_it_used_meanwhile_once() -> None:
    counters = MonotonicCounters()
    samples = [
        ([(7, 5.0), (8, 10.0)], {7: 5.0, 8: 10.0}),
        ([(8, 10.0)], {8: 0.0}),  # 7 left out (the --max-processes cap)
        ([(8, 11.0)], {8: 1.0}),
        ([(7, 25.0), (8, 11.0)], {7: 20.0, 8: 0.0}),
    ]
    for at, (rows, expected) in enumerate(samples):
        if at == 2:  # a new worker takes over: what was left out is carried too
            counters = carried(counters, MonotonicCounters())
        increases = counters.cpu_increases([ProcessCpu(p, "c", s, "x") for p, s in rows])
        assert {key[0]: seconds for key, seconds in increases.items()} == expected, at


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_rows_kept_by_the_source_count_as_rows_made_afresh(data: st.DataObject) -> None:
    """A source that gives the very row again for a process that did not run (eBPF) gets the
    increases, totals and saved state of one that makes every row afresh (procfs), whatever
    changes at a place: a new time, a counter that dropped, other labels, a process more or
    less."""
    draw = data.draw
    kept, fresh = MonotonicCounters(2), MonotonicCounters(2)
    rows = [ProcessCpu(pid, comm, 0.0, cid) for pid, comm, cid in SLOTS[:4]]
    last_seen: dict[tuple, float] = {}
    departed: dict[tuple, float] = {}  # processes left out of a sample: their last seconds
    for step in range(draw(st.integers(2, 12), label="samples")):
        for _ in range(draw(st.integers(0, 3), label="rows replaced")):
            at = draw(st.integers(0, max(len(rows) - 1, 0)))
            pid, comm, cid = draw(st.sampled_from(SLOTS))
            seconds = draw(st.sampled_from([0.0, 0.5, 3.0, 9.0]))
            row = ProcessCpu(pid, comm, seconds, cid)
            change = draw(st.sampled_from(["time", "labels", "add", "remove"]))
            if change == "time" and rows:
                rows[at] = replaced(rows[at], cpu_seconds=rows[at].cpu_seconds + seconds)
            elif change == "labels" and rows:
                rows[at] = row
            elif change == "add":
                rows.insert(at, row)
            elif rows:
                del rows[at]
        copies = [dataclasses.replace(row) for row in rows]
        seen, last = {}, dict(last_seen)
        final = {(row.pid, row.comm, row.container_id): row.cpu_seconds for row in rows}
        # A process back from an earlier sample counts on from its seconds then, where its
        # counter (its last row's) did not drop.
        back = {key: departed[key] for key in final.keys() - last.keys() if key in departed}
        for key in back:
            del departed[key]
        last |= {key: seconds for key, seconds in back.items() if final[key] >= seconds}
        for row in rows:  # the last row of a process counts
            before = last.get(key := (row.pid, row.comm, row.container_id), 0.0)
            seen[key] = row.cpu_seconds - before if row.cpu_seconds >= before else row.cpu_seconds
            last_seen[key] = row.cpu_seconds
        departed |= {key: last_seen[key] for key in last_seen.keys() - seen.keys()}
        last_seen = {key: last_seen[key] for key in seen}
        found = []
        for counters, sample in ((kept, tuple(rows)), (fresh, copies)):
            increases = counters.cpu_increases(sample)
            shown = counters.process_seconds(increases)
            found.append((increases, shown, carry.encode(counters.state())))
        assert found[0][0] == pytest.approx(seen), f"sample {step}"
        assert found[0] == found[1], f"sample {step}"


SLOW_COUNTERS = (
    "ecc_corrected_total",
    "remapped_rows_uncorrectable",
    "retired_pages_single_bit",
    "pcie_replays",
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_device_counters_follow_their_raw_values_whether_or_not_they_repeat(
    data: st.DataObject,
) -> None:
    """Each device counter is the sum of its raw value's increases (from zero where it dropped),
    whether the slow counters come the same as in the device's last reading (as the nvml source
    gives them between two reads), change, go missing, or the device is down, forgotten, or
    taken over by a new worker."""
    draw = data.draw
    counters = MonotonicCounters()
    expected: dict[tuple[str, str], tuple[float, float]] = {}  # (uuid, name) -> last raw, value

    def made(uuid: str, name: str, raw: float | None) -> float | None:
        if raw is None:
            return None
        last = expected.get((uuid, name))
        value = raw if last is None else last[1] + (raw - last[0] if raw >= last[0] else raw)
        expected[(uuid, name)] = (raw, value)
        return value

    last_raw: dict[str, dict[str, object]] = {}
    for step in range(draw(st.integers(2, 16), label="samples")):
        uuid = draw(st.sampled_from(["GPU-a", "GPU-b"]), label="device")
        action = draw(st.sampled_from(["same", "new", "down", "forget"]), label="action")
        if action == "forget":
            counters.forget([uuid])
            expected = {key: value for key, value in expected.items() if key[0] != uuid}
            continue
        if action == "down":
            assert counters.gpu(gpu(uuid, up=False, pcie_replays=99), step).pcie_replays == 99
            continue
        raw = last_raw.get(uuid) if action == "same" else None
        if raw is None:
            raw = {
                name: draw(st.sampled_from([None, 0, 3, 7]), label=name) for name in SLOW_COUNTERS
            }
            raw["clock_event_seconds"] = draw(
                st.sampled_from([(), (("power", 1.5),), (("power", 0.5), ("thermal", 2.0))]),
                label="clock events",
            )
            last_raw[uuid] = raw
        reading = counters.gpu(gpu(uuid, **raw), step)
        for name in SLOW_COUNTERS:
            assert getattr(reading, name) == made(uuid, name, raw[name]), f"sample {step} {name}"
        events = raw["clock_event_seconds"]
        assert isinstance(events, tuple)
        assert reading.clock_event_seconds == tuple(
            (reason, made(uuid, f"clock_event:{reason}", seconds)) for reason, seconds in events
        ), f"sample {step}"
        if draw(st.booleans(), label="a new worker takes over"):
            saved = json.loads(carry.encode(counters.state()))
            counters = MonotonicCounters()
            counters.restore(saved)


def test_saved_rows_follow_every_change_of_their_mapping() -> None:
    """The offsets of the shown series are saved as the rows of their mapping as it is now: a
    value changed, even to an equal one of another type, a key more or less, another order."""
    rows, offsets = carry.Rows(), {(1, "a", ""): 1.5, (2, "b", "c1"): 0.0}
    saved = lambda: json.loads(carry.encode({"rows": rows.of(offsets)}))["rows"]  # noqa: E731
    assert saved() == [[1, "a", "", 1.5], [2, "b", "c1", 0.0]]
    offsets[(2, "b", "c1")] = 0
    assert carry.encode({"rows": rows.of(offsets)}) == '{"rows":[[1,"a","",1.5],[2,"b","c1",0]]}'
    offsets[(3, "d", "")] = 2.0
    assert saved() == [[1, "a", "", 1.5], [2, "b", "c1", 0], [3, "d", "", 2.0]]
    offsets = {key: offsets[key] for key in reversed(offsets)}
    assert saved() == [[3, "d", "", 2.0], [2, "b", "c1", 0], [1, "a", "", 1.5]]
    del offsets[(2, "b", "c1")]
    assert saved() == [[3, "d", "", 2.0], [1, "a", "", 1.5]]


def test_cpu_active_energy_is_shared_by_cpu_time() -> None:
    attribution = Attribution(process_limit=None)
    zones = lambda uj: (RaplZone("intel-rapl:0", "package", uj, REAL_MAX_UJ),)  # noqa: E731
    before, after = (
        {(1, "a", ""): 0.0, (2, "b", "c1"): 0.0},
        {(1, "a", ""): 0.75, (2, "b", "c1"): 0.25},
    )
    attribution.update(
        SampleInputs(0.0, zones(0), CpuTimes(0, 0), cpu_increases=before, owners=owners(before))
    )
    energy = attribution.update(
        SampleInputs(
            1.0, zones(100_000_000), CpuTimes(1.0, 4.0), cpu_increases=after, owners=owners(after)
        )
    )
    # 100 J at 25 % usage: 25 J active, 3:1.
    assert {row.pid: row.cpu_joules for row in energy.cpu_processes} == {
        "1": pytest.approx(18.75),
        "2": pytest.approx(6.25),
    }
    assert {(row.owner.namespace, row.owner.pod): row.cpu_joules for row in energy.pods} == {
        ("", ""): pytest.approx(18.75),
        ("shop", "web-1"): pytest.approx(6.25),
    }
    assert [(row.container_id, row.owner.container) for row in energy.containers] == [
        ("", ""),
        ("c1", "nginx"),
    ]


def test_psys_then_core_where_no_package_zone() -> None:
    attribution = Attribution()
    zones = lambda uj: (  # noqa: E731
        RaplZone("intel-rapl:0", "psys", uj, REAL_MAX_UJ),
        RaplZone("intel-rapl:1", "dram", 2 * uj, REAL_MAX_UJ),
    )
    attribution.update(SampleInputs(0.0, zones(0), CpuTimes(0, 0)))
    energy = attribution.update(
        SampleInputs(1.0, zones(10_000_000), CpuTimes(1, 1), cpu_increases={(1, "a", ""): 1.0})
    )
    assert energy.cpu_processes[0].cpu_joules == pytest.approx(10.0)
    assert {zone.zone: zone.joules for zone in energy.cpu_zones} == {"psys": 10.0, "dram": 20.0}


def test_estimate_only_with_cpu_tdp_watts_and_labelled() -> None:
    for tdp, expected in ((0.0, ()), (100.0, (("package", "estimate"),))):
        attribution = Attribution(cpu_tdp_watts=tdp)
        attribution.update(SampleInputs(0.0, (), CpuTimes(0, 0)))
        energy = attribution.update(
            SampleInputs(2.0, (), CpuTimes(1, 4), cpu_increases={(1, "a", ""): 1.0})
        )
        assert tuple((zone.zone, zone.source) for zone in energy.cpu_zones) == expected
        if tdp:
            assert energy.cpu_zones[0].joules == pytest.approx(
                50.0
            )  # 100 W x 25 % x 2 s, all active
            assert energy.cpu_processes[0].cpu_joules == pytest.approx(50.0)


def test_a_process_cannot_take_more_than_all_cpus() -> None:
    attribution = Attribution(process_limit=None)
    zones = lambda uj: (RaplZone("intel-rapl:0", "package", uj, REAL_MAX_UJ),)  # noqa: E731
    attribution.update(SampleInputs(0.0, zones(0), CpuTimes(0, 0)))
    # Process 2 came back after eviction with its whole history (1000 s) in one interval of
    # 4 CPU-seconds.
    energy = attribution.update(
        SampleInputs(
            1.0,
            zones(8_000_000),
            CpuTimes(4, 4),
            cpu_increases={(1, "a", ""): 4.0, (2, "b", ""): 1000.0},
        )
    )
    assert [row.cpu_joules for row in energy.cpu_processes] == [
        pytest.approx(4.0),
        pytest.approx(4.0),
    ]


def test_gpu_shares() -> None:
    procs = lambda *utils: tuple(GpuProcess(pid, utilization=u) for pid, u in enumerate(utils))  # noqa: E731
    assert gpu_shares(procs(0.6, 0.2)) == [pytest.approx(0.75), pytest.approx(0.25)]
    assert (
        gpu_shares(procs(None, None, None)) == [pytest.approx(1 / 3)] * 3
    )  # the driver reports none
    assert gpu_shares(procs(0.0, 0.0)) == [0.5, 0.5]  # no kernel ran since the last sample
    assert gpu_shares(procs(None)) == [
        1.0
    ]  # the only process (exclusive-process mode) gets everything
    assert gpu_shares(procs(0.0)) == [1.0]


def test_gpu_idle_is_the_lowest_power_seen_unless_configured() -> None:
    def run(idle_watts: float | None) -> list[Energy]:
        attribution = Attribution(gpu_idle_watts=idle_watts, process_limit=None)
        energies, joules = [], 0.0
        for second, watts in enumerate([100, 300, 60, 200]):
            joules += watts
            procs = (GpuProcess(7, "train", utilization=0.9),) if second != 2 else ()
            reading = gpu("G", energy_joules=joules, processes=procs)
            energies.append(attribution.update(SampleInputs(float(second), gpus=(reading,))))
        return energies

    lowest = run(None)
    # 300 W (lowest so far 300): all idle; 60 W with no process: idle; 200 W, lowest 60: 60 idle,
    # 140 active.
    assert lowest[-1].gpu_idle == (("G", pytest.approx(300 + 60 + 60)),)
    assert lowest[-1].gpu_processes[0].gpu_joules == pytest.approx(140)
    configured = run(50.0)
    assert configured[-1].gpu_idle == (("G", pytest.approx(50 + 60 + 50)),)
    assert configured[-1].gpu_processes[0].gpu_joules == pytest.approx(250 + 150)


def test_gpu_without_energy_counter_integrates_power() -> None:
    attribution = Attribution(gpu_idle_watts=50.0, process_limit=None)
    procs = (GpuProcess(1, "a", utilization=0.6), GpuProcess(2, "b", utilization=0.2))
    attribution.update(SampleInputs(0.0, gpus=(gpu("G", power_watts=250.0, processes=procs),)))
    energy = attribution.update(
        SampleInputs(2.0, gpus=(gpu("G", power_watts=250.0, processes=procs),))
    )
    assert energy.gpu_idle == (("G", pytest.approx(100.0)),)
    assert [row.gpu_joules for row in energy.gpu_processes] == [
        pytest.approx(300.0),
        pytest.approx(100.0),
    ]


def test_top_n_sums_the_rest_into_other_and_series_start_when_shown() -> None:
    attribution = Attribution(process_limit=2)
    zone = lambda uj: (RaplZone("intel-rapl:0", "package", uj, REAL_MAX_UJ),)  # noqa: E731
    attribution.update(SampleInputs(0.0, zone(0), CpuTimes(0, 0)))
    outputs = []
    # All CPUs busy; the node uses 6 J, then 10 J; the processes' CPU-seconds share them.
    for second, (uj, cpu, use) in enumerate(
        [(6_000_000, 6.0, {1: 3.0, 2: 2.0, 3: 1.0}), (16_000_000, 16.0, {1: 0.0, 2: 0.0, 3: 10.0})],
        start=1,
    ):
        energy = attribution.update(
            SampleInputs(
                float(second),
                zone(uj),
                CpuTimes(cpu, cpu),
                cpu_increases={(pid, "x", ""): seconds for pid, seconds in use.items()},
            )
        )
        outputs.append({row.pid: row.cpu_joules for row in energy.cpu_processes})
    assert outputs[0] == {
        "1": pytest.approx(3.0),
        "2": pytest.approx(2.0),
        "other": pytest.approx(1.0),
    }
    # Process 3 used 10 J and enters the top 2 with its series counting from there;
    # process 2 leaves.
    assert outputs[1] == {
        "3": pytest.approx(10.0),
        "1": pytest.approx(3.0),
        "other": pytest.approx(1.0),
    }


def test_process_rows_follow_each_change_of_owner_and_joules_and_only_those() -> None:
    """A process that used nothing keeps its row (the ledger and the counters reuse the last one
    instead of making it anew); one whose pod changed or that used energy gets a new one."""
    attribution, counters = Attribution(process_limit=None), MonotonicCounters()
    zone = lambda uj: (RaplZone("intel-rapl:0", "package", uj, REAL_MAX_UJ),)  # noqa: E731
    web, train = PodRef("shop", "web-1", "nginx"), PodRef("ml", "train-0", "main")
    steps = [  # (CPU seconds of processes 1 and 2, process 2's owner)
        ({1: 1.0, 2: 1.0}, web),
        ({1: 1.0, 2: 1.0}, web),
        ({1: 1.0, 2: 1.0}, train),
        ({1: 2.0, 2: 1.0}, train),
    ]
    seen = []
    for second, (cpu, owner) in enumerate(steps, start=1):
        rows = [ProcessCpu(pid, "x", seconds, "c1") for pid, seconds in cpu.items()]
        increases = counters.cpu_increases(rows)
        shown, _ = counters.process_seconds(increases)
        found = {key: PODS["c1"] if key[0] == 1 else owner for key in increases}
        energy = attribution.update(
            SampleInputs(
                float(second),
                zone(second * 4_000_000),
                CpuTimes(float(second), float(second)),
                cpu_increases=increases,
                owners=found,
            )
        )
        seen.append(
            ({row.pid: row for row in shown}, {row.pid: row for row in energy.cpu_processes})
        )
    owners = [{pid: row.owner.pod for pid, row in joules.items()} for _, joules in seen]
    assert owners == [{"1": "web-1", "2": "web-1"}] * 2 + [{"1": "web-1", "2": "train-0"}] * 2
    assert [{pid: row.cpu_seconds for pid, row in cpu.items()} for cpu, _ in seen] == [
        {1: 1.0, 2: 1.0}
    ] * 3 + [{1: 2.0, 2: 1.0}]
    joules = [{pid: row.cpu_joules for pid, row in rows.items()} for _, rows in seen]
    assert joules[0] == joules[1] == joules[2] and joules[3]["1"] > joules[2]["1"]
    assert joules[3]["2"] == joules[2]["2"]
    # Unchanged rows are the very rows of the sample before; changed ones are new.
    (cpu2, rows2), (cpu3, rows3), (cpu4, rows4) = seen[1], seen[2], seen[3]
    assert rows2["1"] is seen[0][1]["1"] and rows3["1"] is rows2["1"]
    assert rows3["2"] is not rows2["2"] and rows4["2"] is rows3["2"]
    assert cpu2[1] is seen[0][0][1] and cpu4[1] is not cpu3[1] and cpu4[2] is cpu3[2]


def test_each_kind_ranks_processes_by_its_own_joules() -> None:
    attribution = Attribution(gpu_idle_watts=0.0, process_limit=1)
    zone = lambda uj: (RaplZone("intel-rapl:0", "package", uj, REAL_MAX_UJ),)  # noqa: E731
    procs = (GpuProcess(2, "y", utilization=1.0),)
    attribution.update(
        SampleInputs(0.0, zone(0), CpuTimes(0, 0), (gpu("G", energy_joules=0.0, processes=procs),))
    )
    # Process 1 used 9 J of CPU and no GPU; process 2 used 1 J of CPU and all 100 J of the GPU.
    energy = attribution.update(
        SampleInputs(
            1.0,
            zone(10_000_000),
            CpuTimes(1, 1),
            (gpu("G", energy_joules=100.0, processes=procs),),
            cpu_increases={(1, "x", ""): 0.9, (2, "y", ""): 0.1},
        )
    )
    assert [(row.pid, row.cpu_joules) for row in energy.cpu_processes] == [
        ("1", pytest.approx(9.0)),
        ("other", pytest.approx(1.0)),
    ]
    # Process 1 has no GPU energy: no GPU row, so nothing is left out of the GPU family's top 1.
    assert [(row.pid, row.gpu_joules) for row in energy.gpu_processes] == [
        ("2", pytest.approx(100.0)),
    ]


def test_only_processes_with_gpu_energy_have_gpu_rows_and_keep_them() -> None:
    attribution = Attribution(gpu_idle_watts=0.0, process_limit=None)
    cpu = {(1, "kworker/0:1", ""): 0.5, (2, "train", "c3"): 0.1}
    on_gpu = (GpuProcess(2, "train", utilization=1.0, container_id="c3", owner=PODS["c3"]),)

    def sample(now: float, joules: float, processes: tuple[GpuProcess, ...]) -> Energy:
        reading = gpu("G", energy_joules=joules, processes=processes)
        return attribution.update(
            SampleInputs(now, gpus=(reading,), cpu_increases=cpu, owners=owners(cpu))
        )

    sample(0.0, 0.0, on_gpu)
    energy = sample(1.0, 100.0, on_gpu)
    assert [(row.pid, row.gpu_joules) for row in energy.gpu_processes] == [("2", 100.0)]
    assert {row.pid for row in energy.cpu_processes} == {"1", "2"}
    # Off the GPU and still running: its series stays, the kworker still has none.
    energy = sample(2.0, 150.0, ())
    assert [(row.pid, row.gpu_joules) for row in energy.gpu_processes] == [("2", 100.0)]


def test_off_and_all() -> None:
    for limit, expected in ((0, set()), (None, {"1", "2", "3"})):
        attribution = Attribution(process_limit=limit)
        increases = {(pid, "x", ""): 1.0 for pid in (1, 2, 3)}
        energy = attribution.update(SampleInputs(0.0, cpu_increases=increases))
        assert {row.pid for row in energy.cpu_processes} == expected
        assert energy.gpu_processes == ()  # none of them has GPU energy
        assert [row.owner.pod for row in energy.pods] == [""]


def test_ended_processes_expire_after_the_grace_period() -> None:
    attribution = Attribution(grace=5.0, process_limit=None)
    attribution.update(
        SampleInputs(0.0, cpu_increases={(1, "a", "c1"): 1.0}, owners=owners({(1, "a", "c1"): 1.0}))
    )
    assert len(attribution.update(SampleInputs(5.0)).cpu_processes) == 1
    energy = attribution.update(SampleInputs(5.5))
    assert (
        energy.cpu_processes == energy.gpu_processes == ()
        and energy.containers == ()
        and energy.pods == ()
    )


def test_gpu_process_labels_win_for_processes_the_pod_list_does_not_know() -> None:
    attribution = Attribution(gpu_idle_watts=0.0, process_limit=None)
    procs = (GpuProcess(900, "", utilization=1.0, owner=PodRef("ml", "train-0", "main")),)
    attribution.update(SampleInputs(0.0, gpus=(gpu("G", energy_joules=0.0, processes=procs),)))
    reading = gpu("G", energy_joules=100.0, processes=procs)
    energy = attribution.update(SampleInputs(1.0, gpus=(reading,)))
    assert [
        (row.pid, row.owner.namespace, row.owner.pod, row.gpu_joules)
        for row in energy.gpu_processes
    ] == [("900", "ml", "train-0", 100.0)]
    assert [(row.owner.namespace, row.owner.pod, row.gpu_joules) for row in energy.pods] == [
        ("ml", "train-0", 100.0)
    ]


# One device per source that cannot list processes, named as that source names it (vendor, uuid).
UNLISTED = [
    ("amd", "AMD-b2c8a7e2f3d41c8f"),
    ("intel", "INTEL-0000:05:00.0"),
    ("nvidia", "JETSON-1421022123456"),
    ("huawei", "ASCEND-0000:C1:00.0-0"),
    ("kunlun", "KL-R200-01"),
]
LISTING = "GPU-listing"  # an NVML device: it lists its processes, so none listed means none runs


def candidates(uuid: str) -> list[PodRef]:
    """The containers that may hold a device: pods of its own, so each device's attributed energy
    can be told apart."""
    return [PodRef("dev", f"{uuid}-{name}", "main") for name in "abc"]


def gain(before: dict[tuple, float], after: dict[tuple, float], key: tuple) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_vendors_device_energy_is_idle_plus_attributed_plus_unattributed(
    data: st.DataObject,
) -> None:
    draw = data.draw
    idle_watts = draw(st.none() | st.floats(0, 300), label="gpu_idle_watts")
    # The "a" container of each device is named by the pod list, so its series carries the
    # container id.
    pods = {f"cid-{uuid}": candidates(uuid)[0] for _, uuid in UNLISTED} | PODS
    devices = [(vendor, uuid, False) for vendor, uuid in UNLISTED] + [("nvidia", LISTING, True)]
    with_counter = {
        uuid: draw(st.booleans(), label=f"{uuid} has an energy counter") for _, uuid, _ in devices
    }
    raw = {uuid: draw(st.floats(0, 1e6)) for _, uuid, _ in devices}
    raw_at_last_up: dict[str, float] = {}
    by_power: set[str] = set()  # counters that went unread: their return is booked by power
    counters = MonotonicCounters()
    attribution = Attribution(gpu_idle_watts=idle_watts, process_limit=None, grace=1e9)
    now, before = 0.0, {}
    for step in range(draw(st.integers(2, 12), label="samples")):
        dt = draw(st.floats(0.05, 5.0), label="interval")
        now += dt
        readings, expected, assigned = [], {}, {}
        for vendor, uuid, lists in devices:
            up = draw(st.integers(0, 4)) > 0
            watts = draw(st.floats(0, 700))
            raw[uuid] += watts * dt
            expected[uuid] = 0.0
            # Now and then NVML cannot read a counter for a sample: power books that interval,
            # and the next with the counter back, never the gap again.
            unread = with_counter[uuid] and draw(st.integers(0, 5), label="unread") == 0
            if up and with_counter[uuid] and not unread:
                if draw(st.integers(0, 9)) == 0:
                    raw[uuid] = draw(st.floats(0, 100))  # reset: the counter starts again
                if uuid in by_power:
                    by_power.discard(uuid)
                    expected[uuid] = watts * dt
                elif uuid in raw_at_last_up:
                    last = raw_at_last_up[uuid]
                    expected[uuid] = raw[uuid] - last if raw[uuid] >= last else raw[uuid]
                raw_at_last_up[uuid] = raw[uuid]
            elif up and step:
                expected[uuid] = watts * dt
                if unread:
                    raw_at_last_up.pop(uuid, None)
                    by_power.add(uuid)
            # The kubelet's assignment changes now and then: nobody, one container, or several.
            assigned[uuid] = tuple(
                draw(st.lists(st.sampled_from(candidates(uuid)), max_size=3, unique=True))
            )
            processes = (
                tuple(
                    GpuProcess(
                        pid,
                        comm,
                        utilization=draw(st.none() | st.floats(0, 1)),
                        container_id=cid,
                        owner=PODS.get(cid, NO_POD),
                    )
                    for pid, comm, cid in draw(
                        st.lists(st.sampled_from(SLOTS), max_size=2, unique=True)
                    )
                )
                if lists
                else ()
            )
            readings.append(
                counters.gpu(
                    GpuReading(
                        index=len(readings),
                        uuid=uuid,
                        vendor=vendor,
                        model="m",
                        up=up,
                        power_watts=watts,
                        processes=processes,
                        lists_processes=lists,
                        energy_joules=raw[uuid] if with_counter[uuid] and not unread else None,
                        holders=holders(*assigned[uuid], pods=pods),
                    ),
                    now,
                )
            )
        after = identities(attribution.update(SampleInputs(now, gpus=tuple(readings))))

        assert_monotonic(before, after)
        assert all(value >= 0 for value in after.values())
        assert increases(before, after, "pod", "gpu") == pytest.approx(
            increases(before, after, "container", "gpu"), abs=1e-6
        )
        listing_idle = gain(before, after, ("idle", LISTING))
        assert increases(before, after, "process", "gpu") + listing_idle == pytest.approx(
            expected[LISTING], rel=1e-6, abs=1e-6
        )
        assert not any(key[:2] == ("unattributed", LISTING) for key in after)
        for _, uuid in UNLISTED:
            own_pods = {ref.pod for ref in candidates(uuid)}
            attributed = sum(
                value - before.get(key, 0.0)
                for key, value in after.items()
                if key[:2] == ("container", "gpu") and key[6] in own_pods
            )
            unattributed = {
                reason: gain(before, after, ("unattributed", uuid, reason))
                for reason in ("shared", "no_owner")
            }
            idle = gain(before, after, ("idle", uuid))
            assert idle + attributed + sum(unattributed.values()) == pytest.approx(
                expected[uuid], rel=0.01, abs=1e-6
            )
            owners = assigned[uuid]
            # Only the reason that applies grows, and a device with one owner gives that
            # container everything.
            assert unattributed["shared"] == 0 or len(owners) > 1
            assert unattributed["no_owner"] == 0 or not owners
            if len(owners) == 1:
                assert sum(unattributed.values()) == 0
            else:
                assert attributed == 0
            if ("idle", uuid) in after:
                assert {
                    ("unattributed", uuid, "shared"),
                    ("unattributed", uuid, "no_owner"),
                } <= after.keys()
        assert not any(key[:2] == ("process", "gpu") and key[5] == "dev" for key in after)
        for key in after:
            if key[:2] == ("container", "gpu") and key[5] == "dev":
                assert key[4] == (f"cid-{key[6][:-2]}" if key[6].endswith("-a") else ""), key
        before = after


def test_an_unlisted_device_gives_its_active_energy_to_its_one_owner() -> None:
    attribution = Attribution(gpu_idle_watts=50.0, process_limit=None)
    amd = GpuReading(
        index=0,
        uuid="AMD-1",
        vendor="amd",
        model="MI210",
        power_watts=250.0,
        lists_processes=False,
        holders=holders(PODS["c3"]),
    )
    attribution.update(SampleInputs(0.0, gpus=(amd,)))
    energy = attribution.update(SampleInputs(2.0, gpus=(amd,)))
    # 500 J in 2 s: 100 J idle, the 400 J above it to the container the kubelet assigned
    # the card to.
    assert energy.gpu_idle == (("AMD-1", pytest.approx(100.0)),)
    assert [
        (row.container_id, row.owner.pod, row.owner.container, row.gpu_joules)
        for row in energy.containers
    ] == [("c3", "train-0", "main", pytest.approx(400.0))]
    assert [(row.owner.pod, row.gpu_joules) for row in energy.pods] == [
        ("train-0", pytest.approx(400.0))
    ]
    assert energy.gpu_processes == ()
    assert energy.gpu_unattributed == (("AMD-1", "no_owner", 0.0), ("AMD-1", "shared", 0.0))


def test_shared_and_unowned_unlisted_devices_are_unattributed_by_reason() -> None:
    attribution = Attribution(gpu_idle_watts=50.0, process_limit=None)
    # Two replicas of card a; card b is nobody's.
    cards = tuple(
        GpuReading(
            index=i,
            uuid=uuid,
            vendor="intel",
            model="Arc",
            power_watts=150.0,
            lists_processes=False,
            holders=held,
        )
        for i, (uuid, held) in enumerate(
            (("INTEL-a", holders(PODS["c1"], PODS["c3"])), ("INTEL-b", ()))
        )
    )
    attribution.update(SampleInputs(0.0, gpus=cards))
    energy = attribution.update(SampleInputs(1.0, gpus=cards))
    assert energy.gpu_unattributed == (
        ("INTEL-a", "no_owner", 0.0),
        ("INTEL-a", "shared", pytest.approx(100.0)),
        ("INTEL-b", "no_owner", pytest.approx(100.0)),
        ("INTEL-b", "shared", 0.0),
    )
    assert energy.containers == () and energy.pods == ()


def test_a_device_that_lists_processes_is_idle_without_one_whoever_holds_it() -> None:
    attribution = Attribution(gpu_idle_watts=50.0, process_limit=None)
    nvidia = gpu("G", power_watts=250.0, holders=holders(PODS["c3"]))
    attribution.update(SampleInputs(0.0, gpus=(nvidia,)))
    energy = attribution.update(SampleInputs(2.0, gpus=(nvidia,)))
    assert energy.gpu_idle == (("G", pytest.approx(500.0)),)
    assert energy.gpu_unattributed == () and energy.pods == ()


def test_a_device_gone_for_the_grace_is_forgotten_and_comes_back_as_new() -> None:
    sampler = Sampler(make_config(kube_source="off", device_grace="5s"), SnapshotStore(), slots=[])

    def at(now: float, **energy: float) -> dict[str, tuple[int, float | None, float | None]]:
        """uuid -> (gpu index, gpu_energy_joules_total, idle joules) of a sample at `now` of the
        devices given with their driver energy counters."""
        readings = tuple(gpu(uuid, energy_joules=joules) for uuid, joules in energy.items())
        snapshot = sampler._assemble(SourceReading(gpus=readings), now)
        idle = dict(snapshot.energy.gpu_idle)
        found = {g.uuid: (g.index, g.energy_joules, idle.pop(g.uuid, None)) for g in snapshot.gpus}
        return found | {uuid: (-1, None, joules) for uuid, joules in idle.items()}

    at(0.0, A=100.0, B=10.0)
    assert at(1.0, A=200.0, B=20.0) == {"A": (0, 200.0, 100.0), "B": (1, 20.0, 10.0)}
    assert at(2.0, A=50.0, B=30.0)["A"] == (0, 250.0, 150.0)  # A reset: its counter goes on
    # Absent, A keeps its idle series for --device-grace (5 s since it was last listed at 2 s).
    assert at(7.0, B=80.0)["A"] == (-1, None, 150.0)
    assert "A" not in at(7.5, B=85.0)
    # Back after that, A is a new device: a new index, counters from the driver's value and zero.
    assert at(8.0, A=60.0, B=90.0)["A"] == (2, 60.0, None)
    assert at(9.0, A=70.0, B=100.0)["A"] == (2, 70.0, 10.0)


def test_a_uuid_two_sources_list_under_two_vendors_is_one_device_with_its_own_counter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler = Sampler(make_config(kube_source="off"), SnapshotStore(), slots=[])
    found = []
    for now, nvml, plugin in [(0.0, 5e6, 1e6), (1.0, 5e6 + 100, 1e6), (2.0, 5e6 + 200, 1e6)]:
        readings = (
            gpu("GPU-1", energy_joules=nvml),
            dataclasses.replace(gpu("GPU-1", energy_joules=plugin), vendor="custom"),
        )
        with caplog.at_level(logging.WARNING):
            snapshot = sampler._assemble(SourceReading(gpus=readings), now)
        found.append([(g.vendor, g.index, g.energy_joules) for g in snapshot.gpus])
    assert found == [[("nvidia", 0, 5e6)], [("nvidia", 0, 5e6 + 100)], [("nvidia", 0, 5e6 + 200)]]
    # Said once, not at every sample: two chips a broken board or VM gives one uuid look the same.
    told = [r.getMessage() for r in caplog.records if "listed twice" in r.getMessage()]
    assert len(told) == 1 and "GPU-1" in told[0] and "custom" in told[0], told


def test_at_most_256_absent_devices_are_remembered_the_longest_absent_forgotten_first() -> None:
    devices = DeviceIndexes()
    devices.number([gpu(f"old-{i:03}") for i in range(100)], 0.0)
    devices.number([gpu(f"new-{i:03}") for i in range(200)], 1.0)
    devices.number([gpu("present")], 2.0)
    forgotten = devices.expire(2.0, grace=3600.0)
    assert forgotten == {f"old-{i:03}" for i in range(44)}
    assert len(devices.state()["devices"]) == 1 + MAX_ABSENT
    assert devices.number([gpu("another")], 3.0)[0].index == 301, "an index is never reused"
