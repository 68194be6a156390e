"""The sampling loop: owns the sources and the clock, publishes immutable snapshots."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from kepler_bridge.sampling import sanitize
from kepler_bridge.sampling import carry
from kepler_bridge.sampling.attribution import Attribution, SampleInputs
from kepler_bridge.config import Config
from kepler_bridge.sampling.counters import CounterGuard
from kepler_bridge.sampling.device_index import DeviceIndexes
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.kube.view import KubeView
from kepler_bridge.reload import KUBE, ConfigFileWatch, reread
from kepler_bridge.model import (NO_POD, ContainerCpu, CpuTimes, GpuReading, ProcessCpu, RaplZone, Snapshot,
                                 SourceReading, SourceStatus)
from kepler_bridge.sources import selected_groups, source_class
from kepler_bridge.sources.base import Source, SourceAbsent, SourceUnavailable, Retry
from kepler_bridge.store import SnapshotStore

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0


@dataclass
class _Slot:
    """One configured source and its health."""

    name: str
    source: Source | None
    started: bool = False
    error: str = ""
    errors_total: int = 0
    retry: Retry = field(default_factory=lambda: Retry(MAX_BACKOFF_SECONDS))
    unused: str = ""  # SourceStatus.unused: "absent" or "standby"
    last: SourceReading = field(default_factory=SourceReading)

    def fail(self, message: str, interval: float, now: float) -> None:
        self.error, self.unused = message, ""
        self.errors_total += 1
        self.retry.failed(interval, now)

    def absent(self, message: str, interval: float, now: float) -> None:
        """No such hardware here, which is no failure; tried again later, as a driver may load or a device appear."""
        self.error, self.unused = message, "absent"
        self.retry.failed(interval, now)


@dataclass
class _Carried:
    """What a new worker takes over from the one before it: counter states, device indexes, source error counts."""

    counters: CounterGuard
    devices: DeviceIndexes
    attribution: Attribution
    source_errors: dict[str, int]


def build_slots(config: Config) -> list[_Slot]:
    """Start the configured sources; within a group the first that starts is used and those before it stand by."""
    groups = selected_groups(config)
    slots: list[_Slot] = []
    for group in groups:
        for position, name in enumerate(group):
            slot = _open(name, config)
            if slot.started or position == len(group) - 1:
                if slot.unused:
                    log.info("source %s is absent: %s", name, slot.error)
                slots.append(slot)
                break
            # An alternative that lost to the next one is never retried: both would count the same CPU time.
            log.warning("source %s is unavailable, %s takes its place: %s", name, group[position + 1], slot.error)
            slots.append(_Slot(name, None, error=slot.error, errors_total=slot.errors_total,
                               unused=slot.unused or "standby"))
    return slots


def _open(name: str, config: Config) -> _Slot:
    source = source_class(name)(config)
    slot = _Slot(name, source)
    try:
        source.start()
        slot.started = True
    except SourceAbsent as err:
        slot.absent(str(err), config.interval, time.monotonic())
    except SourceUnavailable as err:
        slot.fail(str(err), config.interval, time.monotonic())
    except Exception as err:  # a broken driver must not stop the agent
        slot.fail(f"{type(err).__name__}: {err}", config.interval, time.monotonic())
    return slot


def _stop_source(slot: _Slot) -> None:
    if slot.source is not None and slot.started:
        try:
            slot.source.stop()
        except Exception as err:
            log.warning("stopping source %s: %s", slot.name, err)


class Sampler:
    """Reads every source once per interval and publishes one Snapshot per sample; with `state_dir` it continues
    the counters a previous worker saved there and saves its own after every sample."""

    def __init__(self, config: Config, store: SnapshotStore, slots: list[_Slot] | None = None,
                 state_dir: str = "", flags: Mapping[str, object] | None = None) -> None:
        """`flags`: the command line the settings came from; with it, `reload()` and a change of the config file
        re-read the settings at the next sample."""
        self.config = config
        self.store = store
        self.slots = build_slots(config) if slots is None else slots
        self._counters = CounterGuard(config.process_metrics)
        self._devices = DeviceIndexes()
        self._attribution = Attribution(**_attribution_settings(config))
        self._state_dir = state_dir
        self._save_failed = False
        self._flags = flags
        self._config_file = ConfigFileWatch(config.config_file)
        self._reload = threading.Event()
        if state_dir:
            self._take_over(carry.load(state_dir))
        self.kube = KubeMetadata(config)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.kube.start()
        self._thread = threading.Thread(target=self._run, name="kepler-bridge-sampler", daemon=True)
        self._thread.start()

    def reload(self) -> None:
        """Re-read the settings before the next sample (SIGHUP)."""
        self._reload.set()

    def _reread_settings(self) -> None:
        """Apply settings changed by reload() or in the config file; counters, drivers and eBPF stay."""
        if self._flags is None or not (self._config_file.changed() or self._reload.is_set()):
            return
        self._reload.clear()
        new = reread(self.config, self._flags)
        if new is None:
            return
        old, self.config = self.config, new
        self._counters.set_process_limit(new.process_metrics)
        self._attribution.configure(**_attribution_settings(new))
        for slot in self.slots:
            if slot.source is not None:
                slot.source.config = new
        if old.command != new.command:
            for slot in [slot for slot in self.slots if slot.name == "command"]:
                _stop_source(slot)
                self.slots.remove(slot)
            if ("command",) in selected_groups(new):
                self.slots.append(_open("command", new))
        if any(getattr(old, name) != getattr(new, name) for name in KUBE):
            self.kube.stop(1.0)
            self.kube = KubeMetadata(new)
            self.kube.start()

    def alive(self) -> bool:
        """Whether the sampling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 1.5) -> None:
        """Stop sampling and release the sources, within about `timeout` seconds."""
        self._stop.set()
        self.kube.stop(timeout / 3)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in a driver call: releasing it now could crash the driver
                return
        for slot in self.slots:
            _stop_source(slot)

    def _take_over(self, carried: object) -> None:
        if isinstance(carried, _Carried):
            self._counters, self._devices, self._attribution = carried.counters, carried.devices, carried.attribution
            for slot in self.slots:
                slot.errors_total += carried.source_errors.get(slot.name, 0)
            # The state came with the settings of the worker that saved it; these are the ones in force.
            self._counters.set_process_limit(self.config.process_metrics)
            self._attribution.configure(**_attribution_settings(self.config))
            # That worker may have reloaded settings since start-up: read them as they are now.
            self._reload.set()

    def _save(self) -> None:
        if not self._state_dir:
            return
        state = _Carried(self._counters, self._devices, self._attribution,
                         {slot.name: slot.errors_total for slot in self.slots})
        try:
            carry.save(self._state_dir, state)
        except Exception as err:  # the state is a convenience: sampling goes on without it
            if not self._save_failed:
                log.warning("cannot save counter state in %s (counters restart from zero if the worker restarts): "
                            "%s; free space on its file system", self._state_dir, err)
            self._save_failed = True

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            self._reread_settings()
            snapshot = self.sample()
            self._save()  # before publishing: a new worker continues from at least what any scrape has seen
            self.store.publish(snapshot)
            deadline += self.config.interval
            now = time.monotonic()
            if deadline < now:  # fell behind (slow driver): skip missed ticks instead of bursting
                deadline = now
            self._stop.wait(deadline - now)

    def sample(self) -> Snapshot:
        """Read all sources once and build the snapshot."""
        started = time.monotonic()
        gpus: list[GpuReading] = []
        processes: list[ProcessCpu] = []
        zones: list[RaplZone] = []
        cpu_times: CpuTimes | None = None
        attached: int | None = None
        for slot in self.slots:
            reading = self._read(slot, started)
            gpus.extend(reading.gpus)
            processes.extend(reading.processes)
            zones.extend(reading.rapl_zones)
            cpu_times = reading.cpu_times or cpu_times
            if reading.ebpf_programs_attached is not None:
                attached = (attached or 0) + reading.ebpf_programs_attached
        # Kubernetes owners are joined here, once per sample: every output reads them from the rows.
        kube = self.kube.view()
        node_gpus = tuple(join_owners(self._counters.gpu(gpu), kube) for gpu in self._devices.number(gpus))
        increases = self._counters.cpu_increases(processes)
        shown, other_seconds = self._counters.process_seconds(increases)
        self.kube.notice({key.container_id for key in increases if key.container_id} |
                         {proc.container_id for gpu in node_gpus for proc in gpu.processes if proc.container_id})
        energy = self._attribution.update(SampleInputs(
            now=started, rapl_zones=tuple(zones), cpu_times=cpu_times, gpus=node_gpus, cpu_increases=increases,
            owners={key: kube.containers.get(key.container_id, NO_POD) for key in increases}))
        containers = tuple(ContainerCpu(container_id, seconds, kube.containers.get(container_id, NO_POD))
                           for container_id, seconds in self._counters.containers(increases))
        return Snapshot(
            node=self.config.node_name,
            timestamp=time.time(),
            duration_seconds=time.monotonic() - started,
            interval_seconds=self.config.interval,
            sources=tuple(SourceStatus(s.name, s.started and not s.error, s.error, s.errors_total, s.unused)
                          for s in self.slots),
            gpus=node_gpus,
            processes=shown,
            process_cpu_other=other_seconds,
            process_limit=self.config.process_metrics,
            containers=containers,
            ebpf_programs_attached=attached,
            energy=energy,
        )

    def _read(self, slot: _Slot, now: float) -> SourceReading:
        if slot.source is None:
            return SourceReading()
        if not slot.started:
            if not slot.retry.due(now):
                return slot.last
            try:
                slot.source.start()
                slot.started, slot.error, slot.unused = True, "", ""
                slot.retry.succeeded()
            except SourceAbsent as err:
                slot.absent(str(err), self.config.interval, now)
                return slot.last
            except Exception as err:
                slot.fail(str(err) or type(err).__name__, self.config.interval, now)
                return slot.last
        try:
            reading = _read_clean(slot.source)
        except Exception as err:
            log.debug("source %s failed", slot.name, exc_info=True)
            slot.error = str(err) or type(err).__name__
            slot.errors_total += 1
            return dataclasses.replace(slot.last, gpus=tuple(
                dataclasses.replace(gpu, up=False, error=slot.error) for gpu in slot.last.gpus))
        slot.error = ""
        slot.last = reading
        return reading


def _attribution_settings(config: Config) -> dict[str, Any]:
    return {"cpu_tdp_watts": config.cpu_tdp_watts, "gpu_idle_watts": config.gpu_idle_watts,
            "process_limit": config.process_metrics, "grace": config.process_grace,
            "max_processes": config.max_processes}


def join_owners(gpu: GpuReading, kube: KubeView) -> GpuReading:
    """The reading with the containers holding it and each process's owner."""
    held = dataclasses.replace(gpu, holders=kube.holders(gpu))
    fallback = held.holder.owner if held.holder is not None else NO_POD
    processes = []
    for proc in gpu.processes:
        # A process's own container decides. One in a container the pod list does not name, or one the agent
        # cannot see in /proc (no comm: another pid namespace), gets the GPU's one holder; a host process none.
        owner = kube.containers.get(proc.container_id) if proc.container_id else None
        if owner is None:
            owner = fallback if proc.container_id or not proc.comm else NO_POD
        processes.append(dataclasses.replace(proc, owner=owner))
    return dataclasses.replace(held, processes=tuple(processes))


def _read_clean(source: Source) -> SourceReading:
    """One read, sanitised: the only way readings enter a snapshot or `doctor`."""
    return sanitize.reading(source.read())


def check_source(name: str, config: Config) -> tuple[bool, str]:
    """Start and read one source once, for `doctor`: whether it works and one line saying what or why not."""
    source = source_class(name)(config)
    try:
        source.start()
    except (SourceAbsent, SourceUnavailable) as err:
        return False, str(err)
    except Exception as err:
        return False, f"{type(err).__name__}: {err}"
    try:
        return True, source.describe(_read_clean(source))
    except Exception as err:
        return False, f"started, but reading failed: {err}"
    finally:
        source.stop()
