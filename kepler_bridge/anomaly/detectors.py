"""The workload failure modes of one device: stuck work and a memory leak.

Each takes a device's samples in order (`update`), keeps a fixed amount of state, and says whether
its failure shows now. `sensitivity` (1 by default) divides every margin: 2 alarms at half the
deviation, 0.5 only at twice it. The hold times stay: they are what keeps noise from alarming.
"""

from __future__ import annotations

from collections import deque

from kepler_bridge.anomaly.features import Features
from kepler_bridge.anomaly.signals import Hold


class Stuck:
    """Utilization pinned high while power sits near idle, or the reverse, for two minutes.

    A kernel that spins (a deadlocked collective, a hung NCCL ring) keeps NVML's "a kernel ran"
    utilization at 100 % while the SMs do no arithmetic, so the board draws little more than idle;
    power far above idle with no kernel running is a context the driver never released."""

    kind = "stuck"

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.idle: float | None = None  # lowest power seen, creeping up 1 W per 10 min
        self.peak = 0.0
        self.hold = Hold(120.0, 60.0)

    def update(self, f: Features, elapsed: float) -> bool:
        if f.utilization is None or f.power is None:
            return self.hold.update(f.timestamp, False)
        self.peak = max(self.peak, f.power)
        limit = f.power_limit or self.peak
        idle_now = f.utilization <= 0.05
        if self.idle is None:
            # First seen at work: its power says nothing of idle; a typical idle share until an
            # idle sample says more (0.3 x the limit made a third-of-the-limit job "spinning").
            self.idle = f.power if idle_now else 0.15 * limit
        # The estimate creeps up only while idle: at work the board never shows its idle, and
        # creeping there took it to 0.3 x the limit within hours of a long job.
        rising = self.idle + (elapsed / 600.0 if idle_now else 0.0)
        self.idle = min(rising, f.power, 0.3 * limit)
        span = max(limit - self.idle, 1.0)
        low = self.idle + span * 0.12 / self.sensitivity
        high = self.idle + span * min(0.9, 0.45 / self.sensitivity)
        spinning = f.utilization >= 0.9 and f.power < low
        held = f.utilization <= 0.05 and f.power > high
        return self.hold.update(f.timestamp, spinning or held)

    def gap(self) -> None:
        self.hold.reset()


class MemoryLeak:
    """Device memory in use rising steadily for three minutes, or in bursts for twelve, while the
    same processes run and the load does not grow.

    Frameworks allocate their pools and caches as a model loads or a batch size grows, then hold
    them; memory that keeps climbing in small steps under an unchanged process set and load is
    memory that is allocated and never freed. A leak of a batch's buffers, or one per periodic
    job, climbs in bursts (once a minute, flat between) that most 15-second steps miss: a second
    window, a point a minute for twelve minutes, takes a climb spread over all its quarters at half
    the pace, where a model (re)load or a cache's warm-up is one step up, then flat."""

    kind = "memory_leak"
    STEP = 15.0  # seconds per point of the window
    POINTS = 13
    MINUTE = 60.0  # seconds per point of the bursts' window, POINTS long too

    def __init__(self, sensitivity: float = 1.0) -> None:
        self.sensitivity = sensitivity
        self.points: deque[tuple[float, float, float]] = deque(maxlen=self.POINTS)  # t, bytes, util
        self.minutes: deque[tuple[float, float, float]] = deque(maxlen=self.POINTS)
        self.processes: frozenset[int] | None = None
        self.hold = Hold(0.0, 120.0)
        # `_leaking`'s last verdict and what it depends on: the last point (the very tuple: a new
        # one comes every STEP seconds or after a clear), the total and the sensitivity.
        self._judged: tuple[object, float | None, float, bool] | None = None

    def update(self, f: Features, elapsed: float) -> bool:
        if f.memory_used is None or (f.processes is not None and not f.processes):
            self._clear()
            return self.hold.update(f.timestamp, False)
        # None: the source cannot list processes (amdgpu); the steadiness of the climb still tells
        # a leak from a load.
        if f.processes is not None and f.processes != self.processes:
            self.processes = f.processes
            self._clear()
        if not self.points or f.timestamp - self.points[-1][0] >= self.STEP:
            point = (f.timestamp, f.memory_used, f.utilization or 0.0)
            self.points.append(point)
            # Only with a point of the window: the verdict changes with the window's last point.
            if not self.minutes or f.timestamp - self.minutes[-1][0] >= self.MINUTE:
                self.minutes.append(point)
        return self.hold.update(f.timestamp, self._judge(f.memory_total))

    def _judge(self, total: float | None) -> bool:
        """`_leaking`, worked out again only when what it depends on changed."""
        last = self.points[-1] if self.points else None
        judged = self._judged
        if (
            judged is None
            or judged[0] is not last
            or judged[1] != total
            or judged[2] != self.sensitivity
        ):
            judged = self._judged = (last, total, self.sensitivity, self._leaking(total))
        return judged[3]

    def _leaking(self, total: float | None) -> bool:
        if len(self.points) < self.POINTS:
            return False
        total = total or max(p[1] for p in self.points)
        needed = max(256 * 2**20, 0.01 * total) / self.sensitivity
        steps = self._climb(self.points, total, needed)
        if steps and sum(step > 0 for step in steps) >= len(steps) - 2:
            return True
        # In bursts: twice the growth in twelve minutes, a sixteenth of it in each quarter at least.
        steps = self._climb(self.minutes, total, 2 * needed)
        if not steps:
            return False
        quarter = len(steps) // 4
        return min(sum(steps[i : i + quarter]) for i in range(0, len(steps), quarter)) >= needed / 8

    def _climb(
        self, points: deque[tuple[float, float, float]], total: float, needed: float
    ) -> list[float]:
        """The steps of a full window that grew by `needed` with no fall, its load not rising;
        none where it did not."""
        if len(points) < self.POINTS or points[-1][1] - points[0][1] < needed:
            return []
        steps = [b[1] - a[1] for a, b in zip(points, list(points)[1:])]
        half = len(points) // 2
        load = [p[2] for p in points]
        busier = sum(load[half:]) / (len(load) - half) - sum(load[:half]) / half
        return steps if min(steps) >= -0.002 * total and busier < 0.15 else []

    def _clear(self) -> None:
        self.points.clear()
        self.minutes.clear()

    def gap(self) -> None:
        self._clear()
        self.hold.reset()
