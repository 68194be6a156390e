"""How well the anomaly detectors find the failure modes, on labelled traces, beside static
thresholds; and what they cost per device and sample.

Traces (benchmarks/anomaly_traces.py): five normal patterns (steady serving, bursty batches,
diurnal load, idle nights, model reloads), each failure mode injected into each pattern at a known
time after a 4-hour warm-up, a clean day of each pattern, and two faults nothing was written for
(a slow power drift, a device that reboots). The detectors (kepler_bridge/anomaly, the same
`DeviceWatch` the agent runs) take the samples one by one; the IsolationForest is fitted
in-process on the watch's window every --refit.

Printed per kind and overall: precision, recall, F1 and the median delay from the fault's start
to the first alarm, and false alarms per device-day on the clean traces, for the detectors and for
a static-threshold baseline (utilization > 90 % for 5 min, temperature > 85 °C for 5 min, memory
> 90 % for 5 min, power or temperature unchanged for 5 min, a throttle reason active for 5 min,
any error counted in 10 min). A fault's alarm counts from its start to 5 minutes after its end;
an alarm of a consequence (cooling that throttles) is neither a hit nor a false alarm.

The thresholds were set on seeds 1-3 (`--seeds 1,2,3`). Seeds 101-103 were the first held-out
evaluation; what it showed (the thermal detectors' false alarms) was fixed, which made them
seen, so the default evaluation seeds are now 201-203, not looked at while setting anything.
A last line gives what the model costs an agent at a 1 s interval once fitted: the detection's CPU
per sample of 8 devices with an hour's model, and a fit of their hours in the agent's child.
Targets (issue 20): overall F1 >= 0.9, median delay < 5 min, < 1 false alarm per device-day on
clean traces, better than the baseline on every kind.

    python benchmarks/anomaly.py [--seeds 201,202,203] [--interval 5] [--no-model]
"""

from __future__ import annotations

import argparse
import io
import resource
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import anomaly_traces as traces  # noqa: E402

from kepler_bridge.anomaly import KINDS, UNUSUAL, fit  # noqa: E402
from kepler_bridge.anomaly.features import Features  # noqa: E402
from kepler_bridge.anomaly.forest import fit_all, read_forests  # noqa: E402
from kepler_bridge.anomaly.watch import DeviceWatch  # noqa: E402

GRACE = 300.0
Episodes = dict[str, list[tuple[float, float]]]


@dataclass
class Cost:
    samples: int = 0
    seconds: float = 0.0
    fits: int = 0
    fit_seconds: float = 0.0


@dataclass
class Score:
    hits: int = 0
    misses: int = 0
    false: int = 0
    delays: list[float] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)

    def row(self) -> tuple[float, float, float, float | None]:
        found = self.hits + self.false
        precision = self.hits / found if found else 1.0
        recall = self.hits / (self.hits + self.misses) if self.hits + self.misses else 1.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        delay = statistics.median(self.delays) if self.delays else None
        return precision, recall, f1, delay


def episodes(flags: Iterable[tuple[float, set[str]]]) -> Episodes:
    """Each kind's alarms as (start, end) from a trace's per-sample firing sets."""
    found: Episodes = defaultdict(list)
    since: dict[str, float] = {}
    last = 0.0
    for t, firing in flags:
        for kind in firing - since.keys():
            since[kind] = t
        for kind in set(since) - firing:
            found[kind].append((since.pop(kind), t))
        last = t
    for kind, start in since.items():
        found[kind].append((start, last))
    return found


def detect(trace: traces.Trace, args: argparse.Namespace, cost: Cost) -> Episodes:
    """Run the agent's detectors (and model) over a trace."""
    watch = DeviceWatch("trace", args.sensitivity, args.window)
    flags: list[tuple[float, set[str]]] = []
    next_fit = 0.0
    for f in trace.samples:
        if f is None:
            watch.gap()
            continue
        started = time.process_time()
        report = watch.update(f)
        cost.seconds += time.process_time() - started
        cost.samples += 1
        flags.append((f.timestamp, set(report.firing)))
        if args.model and f.timestamp >= next_fit and watch.ready():
            started = time.process_time()
            fitted = {"trace": fit.fit(list(watch.rows), trace.seed)}
            watch.forest = read_forests(io.BytesIO(fit.encode(fitted)), f.timestamp)["trace"]
            cost.fit_seconds += time.process_time() - started
            cost.fits += 1
            next_fit = f.timestamp + args.refit
    return episodes(flags)


def baseline(trace: traces.Trace) -> Episodes:
    """The static thresholds' alarms over a trace: each rule held for 5 minutes."""
    rules: list[tuple[str, Callable[[Features, Features], bool]]] = [
        ("stuck", lambda f, _: (f.utilization or 0) > 0.9),
        ("cooling", lambda f, _: (f.temperature or 0) > 85),
        ("memory_leak", lambda f, _: (f.memory_used or 0) > 0.9 * (f.memory_total or 1)),
        ("frozen_sensor", lambda f, old: f.power == old.power),
        ("frozen_sensor", lambda f, old: f.temperature == old.temperature),
        ("throttling", lambda f, _: f.throttled or f.power_capped),
    ]
    since: dict[int, float] = {}
    errors: list[tuple[float, tuple[int, int, int, int]]] = []
    flags: list[tuple[float, set[str]]] = []
    old: Features | None = None
    for f in trace.samples:
        if f is None:
            since.clear()
            old = None
            continue
        firing = set()
        for number, (kind, rule) in enumerate(rules):
            if old is not None and rule(f, old):
                since.setdefault(number, f.timestamp)
            else:
                since.pop(number, None)
            if number in since and f.timestamp - since[number] >= 300.0:
                firing.add(kind)
        errors = [(t, e) for t, e in errors if t >= f.timestamp - 600.0] + [(f.timestamp, f.errors)]
        if errors[0][1] != f.errors:
            firing.add("error_burst")
        flags.append((f.timestamp, firing))
        old = f
    return episodes(flags)


def score(
    scores: dict[str, Score], trace: traces.Trace, found: Episodes, kinds: tuple[str, ...]
) -> None:
    """Count the trace's hits, misses and false alarms per kind."""
    fault = trace.fault
    for kind in kinds:
        # The model is not told what to look for: any injected fault is its to find.
        own = fault is not None and (fault.kind == kind or kind == UNUSUAL)
        also = fault is not None and kind in traces.ALSO.get(fault.kind, set())
        hit: float | None = None
        for start, end in found.get(kind, []):
            inside = fault is not None and start <= fault.end + GRACE and end >= fault.start
            if inside and own:
                hit = start if hit is None else min(hit, start)
            elif not (inside and also):
                scores[kind].false += 1
                scores[kind].wrong.append(f"{trace.name}@{start / 3600:.1f}h")
        if own and fault is not None:
            if hit is None:
                scores[kind].misses += 1
                scores[kind].missed.append(trace.name)
            else:
                scores[kind].hits += 1
                scores[kind].delays.append(max(0.0, hit - fault.start))


def alarms(found: Episodes, kinds: Iterable[str]) -> int:
    return sum(len(found.get(kind, [])) for kind in kinds)


@dataclass
class Tally:
    """What one method (the detectors, or the baseline) did over every trace."""

    scores: dict[str, Score] = field(default_factory=lambda: defaultdict(Score))
    clean_alarms: int = 0
    clean_days: float = 0.0
    unforeseen: list[str] = field(default_factory=list)


def evaluate(args: argparse.Namespace) -> tuple[Tally, Tally, Tally, Cost]:
    """Run the detectors, the model and the baseline over every trace of the seeds."""
    ours, model, static, cost = Tally(), Tally(), Tally(), Cost()
    for seed in args.seeds:
        runs = [traces.clean_trace(p, seed, args.interval) for p in traces.PATTERNS]
        runs += [
            traces.fault_trace(k, p, seed, args.interval)
            for k in traces.FAULTS
            for p in traces.PATTERNS
        ]
        runs += [
            traces.unforeseen_trace(k, p, seed, args.interval)
            for k in traces.UNFORESEEN
            for p in traces.PATTERNS
        ]
        for trace in runs:
            found, fixed = detect(trace, args, cost), baseline(trace)
            for tally, got, kinds in (
                (ours, found, KINDS),
                (static, fixed, KINDS),
                (model, found, (UNUSUAL,)),
            ):
                _count(tally, trace, got, kinds, args.interval)
    return ours, model, static, cost


def _count(
    tally: Tally, trace: traces.Trace, found: Episodes, kinds: tuple[str, ...], dt: float
) -> None:
    if trace.fault is None:
        tally.clean_alarms += alarms(found, kinds)
        tally.clean_days += len(trace.samples) * dt / 86400.0
        score(tally.scores, trace, found, kinds)
    elif trace.fault.kind in traces.UNFORESEEN:
        fault = trace.fault
        hits = sorted(
            (start, kind)
            for kind in kinds
            for start, end in found.get(kind, [])
            if start <= fault.end + GRACE and end >= fault.start
        )
        seen = (
            f"{hits[0][1]} after {(max(0.0, hits[0][0] - fault.start)) / 60:.1f} min"
            if hits
            else "missed"
        )
        tally.unforeseen.append(f"{trace.name}: {seen}")
    else:
        score(tally.scores, trace, found, kinds)


def _line(name: str, score: Score) -> str:
    precision, recall, f1, delay = score.row()
    shown = f"{delay / 60:6.1f}" if delay is not None else "     -"
    counts = f"{score.hits:4d} {score.misses:4d} {score.false:5d}"
    return f"{name:<14} {precision:9.2f} {recall:6.2f} {f1:5.2f} {shown:>9} {counts}"


def report(title: str, tally: Tally, kinds: tuple[str, ...], verbose: bool = False) -> None:
    print(f"\n{title}")
    print(
        f"{'kind':<14} {'precision':>9} {'recall':>6} {'F1':>5} {'delay min':>9} "
        f"{'hit':>4} {'miss':>4} {'false':>5}"
    )
    total = Score()
    for kind in kinds:
        got = tally.scores[kind]
        print(_line(kind, got))
        if verbose and (got.missed or got.wrong):
            print(f"    missed {got.missed} false {got.wrong[:8]}")
        total.hits += got.hits
        total.misses += got.misses
        total.false += got.false
        total.delays += got.delays
    print(_line("overall", total))
    rate = tally.clean_alarms / tally.clean_days if tally.clean_days else 0.0
    print(
        f"false alarms per device-day on clean traces: {rate:.2f} "
        f"({tally.clean_alarms} in {tally.clean_days:.0f} days)"
    )


def steady(devices: int = 8) -> str:
    """What the model costs an agent at a 1 s interval once fitted: the detection's CPU per sample
    of `devices` on clean traces with an hour's model, and a fit of their hours in the agent's
    child (CPU and peak RSS; the peak is the largest child's this process waited for)."""
    watches, streams = [], []
    for device in range(devices):
        samples = [f for f in traces.clean_trace("steady", 300 + device, 1.0, 1.3).samples if f]
        watch = DeviceWatch(f"trace{device}", 1.0, 3600.0)
        for f in samples[:3600]:
            watch.update(f)
        watches.append(watch)
        streams.append(samples[3600:4500])
    rows = {watch.uuid: list(watch.rows) for watch in watches}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    fitted = fit_all(rows, 1, 0.0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    for watch in watches:
        watch.forest = fitted[watch.uuid]
    started = time.process_time()
    for at in range(len(streams[0])):
        for watch, stream in zip(watches, streams):
            watch.update(stream[at])
    per = (time.process_time() - started) / len(streams[0])
    return (
        f"at 1 s with an hour's model, {devices} devices: detection {per * 1e3:.2f} ms of CPU a "
        f"sample; a fit of their hours (720 rows each) in the child {child:.2f} s of CPU, "
        f"peak RSS {after.ru_maxrss / 1024:.0f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="201,202,203", help="comma list (tuning: 1,2,3)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--sensitivity", type=float, default=1.0)
    parser.add_argument("--window", type=float, default=3600.0, help="model window, seconds")
    parser.add_argument("--refit", type=float, default=1800.0, help="seconds between model fits")
    parser.add_argument("--no-model", dest="model", action="store_false")
    parser.add_argument("--verbose", action="store_true", help="name the missed and false alarms")
    args = parser.parse_args()
    args.seeds = [int(seed) for seed in args.seeds.split(",")]
    ours, model, static, cost = evaluate(args)
    print(
        f"seeds {args.seeds}, a sample every {args.interval:g} s, sensitivity {args.sensitivity:g}"
    )
    report("named detectors", ours, KINDS, args.verbose)
    report("static thresholds", static, KINDS)
    if args.model:
        report("IsolationForest (kind unusual) on every fault", model, (UNUSUAL,))
    print("\nfaults no detector was written for (first alarm of any kind):")
    for line in ours.unforeseen:
        print("  " + line)
    if args.model:
        for line in model.unforeseen:
            print("  model " + line)
    per = cost.seconds / max(cost.samples, 1) * 1e6
    fits = cost.fit_seconds / max(cost.fits, 1)
    print(f"\nCPU per device and sample: {per:.0f} us (detectors and model score, process time)")
    print(
        f"CPU per model fit (in-process here; a child in the agent): {fits * 1000:.0f} ms, "
        f"{cost.fits} fits"
    )
    if args.model:
        print(steady())
    return 0


if __name__ == "__main__":
    sys.exit(main())
