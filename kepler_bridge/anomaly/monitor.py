"""The anomaly thread: it takes each snapshot the store publishes, runs every device's detectors
and model on it, and hands its findings back to the store, which attaches them to the next
snapshot. Nothing here runs in the sampler's or a request's thread."""

from __future__ import annotations

import logging
import resource
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Callable

from kepler_bridge.anomaly import KINDS, UNUSUAL, features, forest
from kepler_bridge.anomaly.watch import DeviceWatch
from kepler_bridge.config import Config
from kepler_bridge.model import Anomalies, Snapshot
from kepler_bridge.store import SnapshotStore
from kepler_bridge.turns import TURNS

log = logging.getLogger(__name__)
FIRST_FIT = 30.0  # seconds between tries to fit a device that has no model yet


@dataclass(frozen=True)
class AnomalySettings:
    """The anomaly settings in force."""

    enabled: bool
    window: float
    refit: float
    sensitivity: float

    @classmethod
    def of(cls, config: Config) -> AnomalySettings:
        return cls(
            config.anomaly, config.anomaly_window, config.anomaly_refit, config.anomaly_sensitivity
        )


class AnomalyMonitor:
    """Runs the detectors of every device on the store's snapshots in thread
    `kepler-bridge-anomaly`, and the model fits in a child process from thread
    `kepler-bridge-anomaly-fit`."""

    def __init__(self, store: SnapshotStore, settings: Callable[[], AnomalySettings]) -> None:
        self.store = store
        self.settings = settings
        self.watches: dict[str, DeviceWatch] = {}
        self.cpu_seconds = 0.0
        self._stop = threading.Event()
        self._fitting: threading.Thread | None = None
        self._last_fit = float("-inf")
        self._fit_cpu = 0.0  # the fit thread's and its child's, kept apart: one writer each
        self._thread = threading.Thread(target=self._run, name="kepler-bridge-anomaly", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self.store.published.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        TURNS.defer()
        seen: Snapshot | None = None
        while not self._stop.is_set():
            snapshot = self.store.latest()
            if snapshot is None or snapshot is seen:
                self.store.published.wait(5.0)
                self.store.published.clear()
                continue
            seen = snapshot
            started = time.thread_time()
            try:
                self.store.anomalies = self.take(snapshot)
            except Exception:  # a bug here must not end the thread: logged, the next one tried
                log.exception("anomaly detection failed on a snapshot; report this as a bug")
            self.cpu_seconds += time.thread_time() - started
            TURNS.check()

    def take(self, snapshot: Snapshot) -> Anomalies | None:
        """Run every device's detectors on one snapshot; None while detection is off."""
        settings = self.settings()
        if not settings.enabled:
            self.watches.clear()
            return None
        watches: dict[str, DeviceWatch] = {}
        for gpu in snapshot.gpus:
            TURNS.give_way()
            watch = self.watches.get(gpu.uuid) or DeviceWatch(
                gpu.uuid, settings.sensitivity, settings.window
            )
            watch.configure(settings.sensitivity, settings.window)
            watches[gpu.uuid] = watch
            if gpu.up:
                watch.update(features.of(gpu, snapshot.timestamp))
            else:
                watch.gap()
        self.watches = watches  # a device gone from the snapshot is forgotten
        self._maybe_fit(settings, snapshot.timestamp)
        devices = tuple(w.report() for w in watches.values())
        return Anomalies((*KINDS, UNUSUAL), devices, self.cpu_seconds + self._fit_cpu)

    def _maybe_fit(self, settings: AnomalySettings, now: float) -> None:
        if self._fitting is not None and self._fitting.is_alive():
            return
        ready = {u: list(w.rows) for u, w in self.watches.items() if w.ready()}
        unfitted = any(self.watches[uuid].forest is None for uuid in ready)
        due = min(settings.refit, FIRST_FIT) if unfitted else settings.refit
        if not ready or now - self._last_fit < due:
            return
        self._last_fit = now
        self._fitting = threading.Thread(
            target=self._fit, args=(ready, now), name="kepler-bridge-anomaly-fit", daemon=True
        )
        self._fitting.start()

    def _fit(self, rows: dict[str, list[array[float]]], now: float) -> None:
        started = time.thread_time()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            fitted = forest.fit_all(rows, int(now), now)
        except (RuntimeError, ValueError) as err:
            log.warning("%s; the named detectors still run, the fit is tried again", err)
            fitted = {}
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        for uuid, model in fitted.items():
            watch = self.watches.get(uuid)
            if watch is not None:
                watch.forest = model
        self._fit_cpu += time.thread_time() - started + child
