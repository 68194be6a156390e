"""The named anomaly detectors and the model on labelled traces, their findings through the store
into /metrics and /api/v1/history, and the model's fit beside scikit-learn's."""

from __future__ import annotations

import gc
import io
import random
import statistics
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import anomaly_traces as traces  # noqa: E402

from kepler_bridge.anomaly import KINDS, detectors, fit, forest  # noqa: E402
from kepler_bridge.anomaly.features import Features  # noqa: E402
from kepler_bridge.anomaly.monitor import AnomalyMonitor, AnomalySettings  # noqa: E402
from kepler_bridge.anomaly.watch import Detector, DeviceWatch, named, unusual_above  # noqa: E402
from kepler_bridge.exposition import history, prometheus  # noqa: E402
from kepler_bridge.model import GpuReading, Snapshot  # noqa: E402
from kepler_bridge.store import SnapshotStore  # noqa: E402
from scaffold import by_name  # noqa: E402

SEED = 11  # neither a tuning seed (1-3) nor an evaluation seed (101-103, 201-203) of the benchmark
INTERVAL = 5.0


def _fed(detector: Detector, trace: traces.Trace) -> Iterator[tuple[Features, bool]]:
    """Feed the trace's samples to the detector in order (a gap where one is missing): each
    sample, and whether the detector fires after it."""
    last: float | None = None
    for f in trace.samples:
        if f is None:
            detector.gap()
            last = None
            continue
        yield f, detector.update(f, f.timestamp - last if last is not None else 0.0)
        last = f.timestamp


def _fired(kind: str, trace: traces.Trace) -> list[float]:
    """When the detector of `kind` fired over the trace."""
    detector = next(d for d in named(1.0) if d.kind == kind)
    return [f.timestamp for f, fired in _fed(detector, trace) if fired]


@pytest.mark.parametrize("pattern", ["steady", "bursty"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_detector_fires_on_its_fault_and_not_on_the_clean_trace(
    kind: str, pattern: str
) -> None:
    faulty = traces.fault_trace(kind, pattern, SEED, INTERVAL)
    assert faulty.fault is not None
    fired = _fired(kind, faulty)
    assert fired, f"{kind} did not fire on {faulty.name}"
    assert faulty.fault.start <= fired[0] <= faulty.fault.start + 600.0, (fired[0], faulty.fault)
    clean = traces.clean_trace(pattern, SEED, INTERVAL, hours=12.0)
    assert not _fired(kind, clean), f"{kind} fired on {clean.name}"


@pytest.mark.parametrize("interval", [1.0, 5.0])
def test_an_idle_board_whose_whole_degrees_settle_is_no_frozen_sensor(interval: float) -> None:
    """An hour of work (the temperature moves every few samples), then an hour idle: the power
    jitters by milliwatts and the temperature, read in whole degrees, settles and stays."""
    rng, detector = random.Random(SEED), next(d for d in named(1.0) if d.kind == "frozen_sensor")
    t, temperature, fired = 0.0, 40.0, []
    for step in range(int(7200 / interval)):
        t += interval
        busy = step < 3600 / interval
        utilization = min(1.0, max(0.0, 0.6 + rng.gauss(0, 0.1))) if busy else 0.0
        power = 60 + 200 * utilization + rng.gauss(0, 1.5 if busy else 0.3)
        temperature += (25 + 0.15 * power - temperature) * min(1.0, interval / 60)
        shown = round(temperature + (rng.gauss(0, 0.4) if busy else 0.0))
        f = Features(
            t, round(utilization, 2), 1e9, 80e9, float(shown), round(power, 3), 300.0, 1.4e9,
            1.5e9, 0.3, False, (0, 0, 0, 0), frozenset(), False,
        )  # fmt: skip
        if detector.update(f, interval):
            fired.append(t)
    assert not fired, f"fired {len(fired)} times, first {fired[0] - 3600:.0f} s into the idle hour"


@pytest.mark.parametrize(
    "counts",
    [
        {"ecc_corrected_total": 40},
        {"remapped_rows_correctable": 2, "remapped_rows_uncorrectable": 0},
    ],
)
def test_a_counter_the_device_did_not_give_for_a_while_is_no_burst_when_back(
    counts: dict[str, int],
) -> None:
    """A counter NVML could not read for some samples (None) and back at the value it had counted
    no error: only what it counted meanwhile is new. Counting on from the value, it still fires."""
    monitor = AnomalyMonitor(SnapshotStore(), lambda: AnomalySettings(True, 3600.0, 1e9, 1.0))
    fired = []
    for n in range(400):
        values = {
            field: None if 200 <= n < 210 else count + (100 if n >= 300 else 0)
            for field, count in counts.items()
        }
        gpu = GpuReading(0, "GPU-0", "nvidia", "m", utilization=0.6, power_watts=250.0, **values)
        findings = monitor.take(Snapshot("n", 1.7e9 + n, 0.01, 1.0, gpus=(gpu,)))
        fired.append("error_burst" in findings.devices[0].firing)
    assert not any(fired[:300]), fired.index(True)
    assert fired[300]


@pytest.mark.parametrize("kind", ["stuck", "throttling"])
def test_a_wall_clock_stepped_back_does_not_hold_an_alarm_for_the_step(kind: str) -> None:
    """NTP stepping the clock back an hour while an alarm clears is a gap, as a device unread a
    while is: the alarm does not hold until wall time catches up."""
    trace = traces.fault_trace(kind, "steady", SEED, INTERVAL)
    watch, fired_after = DeviceWatch("GPU-0", 1.0, 3600.0), []
    for f in trace.samples:
        if f is None:
            continue
        stepped = f.timestamp - (3600.0 if f.timestamp >= trace.fault.end + 30.0 else 0.0)
        if kind in watch.update(f._replace(timestamp=stepped)).firing:
            fired_after.append(f.timestamp - trace.fault.end)
    assert fired_after and max(fired_after) < 300.0, max(fired_after)


def test_a_power_limit_near_zero_takes_no_device_out_of_detection() -> None:
    """A plug-in may report a power limit of 1e-310 W (positive, in range): the detectors that
    divide by it raised OverflowError, and no device of the snapshot was checked."""
    monitor = AnomalyMonitor(SnapshotStore(), lambda: AnomalySettings(True, 3600.0, 1e9, 1.0))
    for n in range(3):
        gpus = tuple(
            GpuReading(
                i,
                f"GPU-{i}",
                "nvidia",
                "m",
                power_watts=250.0,
                power_limit_watts=limit,
                temperature_celsius=60.0,
            )
            for i, limit in enumerate((400.0, 1e-310))
        )
        findings = monitor.take(Snapshot("n", 1.7e9 + n, 0.01, 1.0, gpus=gpus))
        assert [device.uuid for device in findings.devices] == ["GPU-0", "GPU-1"]


def test_the_memory_leak_verdict_follows_each_point_total_and_sensitivity() -> None:
    """MemoryLeak keeps its verdict between two points of its window (a point every 15 s, a
    sample every 2 s here): at every sample it is what working it out afresh gives, also right
    after the sensitivity changed between two points."""
    trace = traces.fault_trace("memory_leak", "steady", SEED, 2.0)
    detector = detectors.MemoryLeak()
    verdicts = []
    for f, _ in _fed(detector, trace):
        verdict = detector._judge(f.memory_total)
        assert verdict == detector._leaking(f.memory_total), f.timestamp
        if verdict and detector.sensitivity == 1.0:
            detector.sensitivity = 0.05  # twenty times the growth needed: no leak
            assert detector._judge(f.memory_total) is False
            detector.sensitivity = 1.0
        verdicts.append(verdict)
    assert any(verdicts) and not all(verdicts)


def _snapshot(timestamp: float, temperature: float) -> Snapshot:
    gpu = GpuReading(
        index=0, uuid="GPU-0", vendor="nvidia", model="A100", utilization=1.0, power_watts=40.0,
        power_limit_watts=400.0, temperature_celsius=temperature, memory_used_bytes=1,
        memory_total_bytes=2,
    )  # fmt: skip
    return Snapshot(node="n1", timestamp=timestamp, duration_seconds=0.01, interval_seconds=1.0,
                    gpus=(gpu,))  # fmt: skip


def test_findings_reach_the_next_snapshot_its_metrics_and_history() -> None:
    store = SnapshotStore()
    monitor = AnomalyMonitor(store, lambda: AnomalySettings(True, 3600.0, 600.0, 1.0))
    for second in range(200):  # busy at 100 % on idle power: stuck after 2 minutes
        store.publish(_snapshot(float(second), 35.0 + second % 2))
        store.anomalies = monitor.take(store.latest())
    store.publish(_snapshot(200.0, 35.0))
    snapshot = store.latest()
    assert snapshot.anomalies is not None and snapshot.anomalies.devices[0].firing == ("stuck",)
    text = prometheus.render(snapshot, lambda name: True).decode()
    firing = {labels["kind"]: value for labels, value in by_name(text)["gpu_anomaly"]}
    assert firing["stuck"] == 1.0 and sum(firing.values()) == 1.0
    assert set(firing) >= set(KINDS)
    assert "gpu_anomaly_score" not in by_name(text), "a device without a model has no score"
    device = history.render(store.history, snapshot)
    assert b'"anomalies":["stuck"]' in device


def test_detection_off_exports_nothing() -> None:
    store = SnapshotStore()
    monitor = AnomalyMonitor(store, lambda: AnomalySettings(False, 3600.0, 600.0, 1.0))
    store.publish(_snapshot(1.0, 35.0))
    store.anomalies = monitor.take(store.latest())
    store.publish(_snapshot(2.0, 35.0))
    text = prometheus.render(store.latest(), lambda name: True).decode()
    assert "gpu_anomaly" not in text


def _scores(trace: traces.Trace, fit_at: float) -> tuple[list[float], list[float]]:
    """The model's scores over a trace, fitted once (in the agent's fit child) on the hour before
    `fit_at`: of the normal samples after the fit, and of the fault's."""
    assert trace.fault is not None
    watch = DeviceWatch("trace", 1.0, 3600.0)
    normal: list[float] = []
    faulty: list[float] = []
    for f in trace.samples:
        if f is None:
            watch.gap()
            continue
        if watch.forest is None and f.timestamp >= fit_at:
            watch.forest = forest.fit_all({"trace": list(watch.rows)}, SEED, f.timestamp)["trace"]
        score = watch.update(f).score
        if score is not None:
            into = faulty if trace.fault.start <= f.timestamp < trace.fault.end else normal
            into.append(score)
    return normal, faulty


@pytest.mark.parametrize("pattern", ["steady", "bursty"])
@pytest.mark.parametrize("kind", ["stuck", "cooling"])
def test_the_model_scores_a_fault_that_breaks_the_physics_as_unusual(
    kind: str, pattern: str
) -> None:
    trace = traces.fault_trace(kind, pattern, SEED, INTERVAL)
    assert trace.fault is not None
    normal, faulty = _scores(trace, trace.fault.start - 1800.0)
    usual = statistics.quantiles(normal, n=20)[-1]  # the 95th percentile
    assert statistics.median(faulty) > usual, (statistics.median(faulty), usual)
    above = sum(score >= unusual_above(1.0) for score in faulty) / len(faulty)
    assert above > 0.8, f"only {above:.0%} of the fault's samples count as unusual"
    assert sum(score >= unusual_above(1.0) for score in normal) / len(normal) < 0.2


def test_the_model_scores_a_sample_once_a_row_step_and_its_score_holds_between() -> None:
    """At a 1 s interval the hour's model (a row every 5 s) scores one sample in five: what it
    learned the device at; every sample between carries the last score."""
    trace = traces.clean_trace("steady", SEED, 1.0, hours=0.5)
    watch = DeviceWatch("trace", 1.0, 3600.0)
    samples = [f for f in trace.samples if f is not None]
    for f in samples[:600]:
        watch.update(f)
    model = forest.fit_all({"trace": list(watch.rows)}, SEED, 0.0)["trace"]
    scored: list[float] = []
    watch.forest = model
    score = model.score
    model.score = lambda vector: scored.append(1.0) or score(vector)  # type: ignore[method-assign]
    held = [watch.update(f).score for f in samples[600:900]]
    assert None not in held
    assert 55 <= len(scored) <= 65, len(scored)
    assert len(set(held)) <= len(scored)


def _rank(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0] * len(values)
    for rank, at in enumerate(order):
        ranks[at] = rank
    return ranks


def test_the_forest_scores_rows_as_scikit_learn_does_within_its_own_seeds_and_beyond_them_higher():
    """Our fit grows the trees as scikit-learn's IsolationForest does, with another random stream:
    its scores of the rows differ from scikit-learn's no more than scikit-learn's own do from one
    seed to another, and rank the rows as much alike."""
    from sklearn.ensemble import IsolationForest

    rng = random.Random(SEED)
    rows = [[rng.gauss(0.0, 1.0) for _ in range(4)] for _ in range(400)]
    for row in rows[::40]:
        row[0] = 0.0  # ties, as a sensor's repeated readings give
    ours = forest.fit_all({"d": rows}, SEED, 0.0)["d"]
    scores = [ours.score(row) for row in rows]

    def sklearn(seed: int) -> list[float]:
        model = IsolationForest(n_estimators=fit.TREES, max_samples=256, random_state=seed)
        return [-score for score in model.fit(rows).score_samples(rows)]

    theirs, other = sklearn(SEED), sklearn(SEED + 1)
    apart = statistics.mean(abs(a - b) for a, b in zip(scores, theirs))
    their_apart = statistics.mean(abs(a - b) for a, b in zip(other, theirs))
    assert apart < 1.5 * their_apart, (apart, their_apart)
    assert abs(statistics.mean(scores) - statistics.mean(theirs)) < 0.01
    alike = statistics.correlation(_rank(scores), _rank(theirs))
    assert alike > 0.9 * statistics.correlation(_rank(other), _rank(theirs)), alike
    far = [[4.0, 0.0, 0.0, 0.0], [40.0, 0.0, 0.0, 0.0]]
    assert ours.score(far[1]) > ours.score(far[0]) > max(scores[1:10])


def test_the_fit_child_needs_neither_numpy_nor_scikit_learn() -> None:
    rng = random.Random(SEED)
    rows = [[rng.gauss(0.0, 1.0) for _ in range(3)] for _ in range(forest.MIN_ROWS)]
    hidden = (
        "import runpy, sys\n"
        "sys.modules.update(numpy=None, sklearn=None, scipy=None)\n"
        f"runpy.run_path({fit.__file__!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", hidden],
        input=forest.request({"d": rows}, SEED),
        capture_output=True,
        timeout=60,
        check=True,
    )
    printed = forest.read_forests(io.BytesIO(done.stdout), 0.0)["d"]
    assert len(printed.trees) == fit.TREES
    assert printed.score([9.0, 9.0, 9.0]) > max(printed.score(row) for row in rows)


def _held_bytes(make: Callable[[], object]) -> tuple[object, int]:
    """What `make` returns, and the bytes it still holds (tracemalloc) once made."""
    gc.collect()
    tracemalloc.start()
    try:
        made = make()
        gc.collect()
        return made, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_a_device_holds_its_window_and_its_forest_in_compact_arrays() -> None:
    """At 8 devices the hour's 720 rows as lists and the forests as lists of Python numbers held
    9.4 MB of the worker (586 bytes a row, 120 a node); as arrays 3.9 MB (250 and 49)."""
    trace = traces.clean_trace("steady", SEED, INTERVAL, hours=1.5)

    def watched() -> DeviceWatch:
        watch = DeviceWatch("trace", 1.0, 3600.0)
        for f in trace.samples:
            if f is not None:
                watch.update(f)
        return watch

    watch, held = _held_bytes(watched)
    assert isinstance(watch, DeviceWatch) and len(watch.rows) == 720
    width = len(watch.rows[0])
    assert held < 720 * (8 * width + 160), f"{held / 720:.0f} bytes per row of {width} values"
    rows = list(watch.rows)
    forest.fit_all({"d": rows[: forest.MIN_ROWS]}, SEED, 0.0)  # not held: what a first fit imports
    fitted, held = _held_bytes(lambda: forest.fit_all({"d": rows}, SEED, 0.0)["d"])
    assert isinstance(fitted, forest.Forest)
    nodes = sum(len(tree[0]) for tree in fitted.trees)
    assert held < nodes * 7 * 8 + len(fitted.trees) * 600, f"{held / nodes:.0f} bytes per node"


def test_the_child_prints_raw_arrays_and_a_torn_answer_is_refused() -> None:
    rng = random.Random(SEED)
    rows = [[rng.gauss(0.0, 1.0) for _ in range(3)] for _ in range(60)]
    printed = fit.encode({"d": fit.fit(rows, SEED)})
    ours = forest.read_forests(io.BytesIO(printed), 0.0)["d"]
    child = forest.fit_all({"d": rows}, SEED, 0.0)["d"]
    assert [ours.score(row) for row in rows] == [child.score(row) for row in rows]
    nodes = sum(len(tree[0]) for tree in ours.trees)
    assert len(printed.partition(b"\n")[2]) == nodes * forest.NODE_BYTES
    for torn, why in ((printed[:-1], "fewer bytes"), (printed + b"\0", "more bytes")):
        with pytest.raises(RuntimeError, match=why):
            forest.read_forests(io.BytesIO(torn), 0.0)
    with pytest.raises(ValueError, match="not all 3 values wide"):
        forest.request({"d": rows + [[1.0]]}, SEED)


def test_the_fit_child_refuses_rows_that_are_not_the_ones_announced() -> None:
    rows = [[float(i), 1.0] for i in range(forest.MIN_ROWS)]
    asked = forest.request({"d": rows}, SEED)
    for torn in (asked[:-8], asked + b"\0" * 8):
        done = subprocess.run(
            [sys.executable, "-I", fit.__file__], input=torn, capture_output=True, timeout=60
        )
        assert done.returncode != 0 and not done.stdout
        assert b"not the rows the request announces" in done.stderr, done.stderr


def test_a_fit_that_fails_or_hangs_gives_its_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = {"d": [[float(i), 1.0] for i in range(forest.MIN_ROWS)]}
    for code, why in (
        ("raise SystemExit('no rows here')", "failed: no rows here"),
        ("import time; time.sleep(60)", "did not finish within 1 s"),
    ):
        child = tmp_path / "fit.py"
        child.write_text(code)
        monkeypatch.setattr(fit, "__file__", str(child))
        monkeypatch.setattr(forest, "FIT_TIMEOUT", 1.0)
        with pytest.raises(RuntimeError, match=why):
            forest.fit_all(rows, SEED, 0.0)
