"""The sampling loop: owns the sources and the clock, publishes immutable snapshots."""

from __future__ import annotations

import logging
import threading
import time
from itertools import compress, repeat
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable, Iterable, Mapping, cast

from kepler_bridge.config import Config
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.kube.view import KubeView
from kepler_bridge.model import (
    NO_POD,
    ContainerCpu,
    GpuProcess,
    GpuReading,
    PodRef,
    ProcessLabels,
    Snapshot,
    SourceReading,
    replaced,
)
from kepler_bridge.reload import KUBE, SettingsWatch
from kepler_bridge.sampling import carry, state_file
from kepler_bridge.sampling.attribution import Attribution, SampleInputs
from kepler_bridge.sampling.counters import MonotonicCounters
from kepler_bridge.sampling.device_index import DeviceIndexes
from kepler_bridge.sampling.environment import EnvironmentDevices
from kepler_bridge.sampling.slots import (
    Slot,
    build_slots,
    carry_errors,
    read_all,
    replace_command,
)
from kepler_bridge.sources import CPU_TIME, check_names
from kepler_bridge.store import SnapshotStore
from kepler_bridge.turns import TURNS

log = logging.getLogger(__name__)
_CONTAINER_ID = itemgetter(2)
_HOLDERS, _OWNER = attrgetter("holders"), attrgetter("owner")


class Sampler:
    """Reads every source once per interval and publishes one Snapshot per sample; with
    `state_dir` it continues the counters a previous worker saved there and saves its own after
    every sample."""

    def __init__(
        self,
        config: Config,
        store: SnapshotStore,
        slots: list[Slot] | None = None,
        state_dir: str = "",
        flags: Mapping[str, object] | None = None,
        check: Callable[[Config], None] | None = None,
        remember: Callable[[Config], None] | None = None,
    ) -> None:
        """`flags`: the command line the settings came from; with it, `reload()` and a change of
        the config file re-read the settings at the next sample, refused where `check` (what
        start-up checks beyond each value) raises ConfigError, and told to `remember` once
        taken."""
        self.config = config
        self.store = store
        self.slots = build_slots(config) if slots is None else slots
        self._counters = MonotonicCounters(config.process_metrics)
        self._devices = DeviceIndexes()
        self._attribution = Attribution(**_attribution_settings(config))
        self.kube = KubeMetadata(config)
        self.environment = EnvironmentDevices(config.procfs, enabled=config.device_environment)
        self._state_dir = state_dir
        self._state_file = state_file.StateFile(state_dir)
        self._save_errors = 0
        self._save_warned = False
        # Errors of sources with no slot now (a command unset by a reload), kept for their return.
        self._retired_errors: dict[str, int] = {}
        self._check = check
        self._remember = remember
        self._settings = SettingsWatch(flags, config.config_file, self._acceptable)
        if state_dir:
            self._take_over(state_file.load(state_dir))
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to end the wait for the next sample (stop, reload)
        self._thread: threading.Thread | None = None

    def _acceptable(self, config: Config) -> None:
        """Raise ConfigError for settings start-up would refuse: a source that does not exist,
        or what the check given says (the TLS pair, the web config)."""
        check_names(config)
        if self._check is not None:
            self._check(config)

    def start(self) -> None:
        self.kube.start()
        self._thread = threading.Thread(target=self._run, name="kepler-bridge-sampler", daemon=True)
        self._thread.start()

    def reload(self) -> None:
        """Re-read the settings and sample now (SIGHUP); not from a signal handler, as the
        wake-up takes a lock."""
        self._settings.ask()
        self._wake.set()

    def configure(self, config: Config) -> None:
        """Take new settings: every part gets them; counters, drivers and eBPF stay, the command
        source and the Kubernetes metadata start again where their settings changed."""
        old, self.config = self.config, config
        self._counters.configure(config.process_metrics)
        self._attribution.configure(**_attribution_settings(config))
        self.environment.enabled = config.device_environment
        for slot in self.slots:
            slot.configure(config)
        if old.command != config.command:
            self.slots = replace_command(self.slots, config, self._retired_errors)
        if any(getattr(old, name) != getattr(config, name) for name in KUBE):
            self.kube.stop(1.0)
            self.kube = KubeMetadata(config)
            self.kube.start()

    def alive(self) -> bool:
        """Whether the sampling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 1.5) -> None:
        """Stop sampling and release the sources, within about `timeout` seconds."""
        self._stop.set()
        self._wake.set()
        self.kube.stop(timeout / 3)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in a driver call: releasing it now could crash it
                return
        for slot in self.slots:
            slot.stop()
        self._state_file.close()

    def _take_over(self, carried: dict[str, Any] | None) -> None:
        """Continue from the state a previous worker saved (None: there is none)."""
        if carried is None:
            return
        counters, devices = MonotonicCounters(self.config.process_metrics), DeviceIndexes()
        attribution = Attribution(**_attribution_settings(self.config))
        try:
            counters.restore(carry.field(carried, "counters"))
            devices.restore(carry.field(carried, "devices"))
            attribution.restore(carry.field(carried, "attribution"))
            errors = carry.rows(carry.field(carried, "source_errors"), carry.text, carry.integer)
            save_errors = carry.integer(carry.field(carried, "save_errors"))
            if carry.text(carry.field(carried, "cpu_time")) != self._cpu_time():
                counters.new_cpu_source()
        except Exception as err:  # carry.BadState, or a crafted value no check foresaw
            log.warning(
                "counter state in %s is not this agent's, counters restart from zero: %s",
                self._state_dir,
                err,
            )
            return
        self._counters, self._devices, self._attribution = counters, devices, attribution
        self._save_errors = save_errors
        self._retired_errors = carry_errors(self.slots, dict(errors))
        # The state came with the settings of the worker that saved it; these are in force (that
        # worker may have reloaded settings since start-up: the first sample reads them again).
        self.configure(self.config)

    def _cpu_time(self) -> str:
        """The source in use of the processes' CPU time ("" for none), as the state names it."""
        return ",".join(s.name for s in self.slots if s.name in CPU_TIME and s.source is not None)

    def _save(self) -> None:
        """Save the state for a next worker; when that fails, remove the older one: a new
        worker then starts from zero instead of below what was served."""
        if not self._state_dir:
            return
        errors = {**self._retired_errors, **{slot.name: slot.errors_total for slot in self.slots}}
        state = {
            "counters": self._counters.state(),
            "devices": self._devices.state(),
            "attribution": self._attribution.state(),
            "source_errors": [[name, count] for name, count in errors.items()],
            "save_errors": self._save_errors,
            "cpu_time": self._cpu_time(),
        }
        TURNS.give_way()
        try:
            self._state_file.save(state)
        except Exception as err:  # the state is a convenience: sampling goes on without it
            self._save_errors += 1
            self._save_failed(err)

    def _save_failed(self, err: Exception) -> None:
        """Remove the older state a failed save leaves; warn once per worker."""
        try:
            self._state_file.discard()
            kept = ""
        except OSError as stuck:
            kept = f"; removing the older state failed too ({stuck}): a new worker would go back"
        if not self._save_warned:
            self._save_warned = True
            log.warning(
                "cannot save counter state in %s (counters restart from zero if the worker "
                "restarts; counted in kepler_bridge_state_save_errors_total): %s%s; free space "
                "on its file system",
                self._state_dir,
                err,
                kept,
            )

    def _run(self) -> None:
        TURNS.defer()
        deadline = time.monotonic()
        while not self._stop.is_set():
            self._wake.clear()  # before the settings are read: a reload from now on wakes it
            new = self._settings.new_settings(self.config)
            if new is not None:
                self.configure(new)
                if self._remember is not None:
                    self._remember(new)
            snapshot = self.sample()
            TURNS.give_way()
            # Saved before publishing: a new worker continues from at least what any scrape saw.
            self._save()
            self.store.publish(replaced(snapshot, state_save_errors=self._save_errors))
            TURNS.check()
            deadline += self.config.interval
            now = time.monotonic()
            if deadline < now:  # fell behind (slow driver): skip missed ticks instead of bursting
                deadline = now
            self._wake.wait(deadline - now)

    def sample(self) -> Snapshot:
        """Read all sources once and build the snapshot."""
        started = time.monotonic()
        return self._assemble(read_all(self.slots, self.config.interval, started), started)

    def _number(self, reading: SourceReading, now: float) -> tuple[GpuReading, ...]:
        """The sample's devices with their `gpu` index; the devices gone for --device-grace are
        forgotten, their counters and energy with them."""
        numbered = self._devices.number(reading.gpus, now)
        gone = self._devices.expire(now, self.config.device_grace)
        if gone:
            self._counters.forget(gone)
            self._attribution.forget(gone)
        return numbered

    def _assemble(self, reading: SourceReading, started: float) -> Snapshot:
        """The snapshot of one sample: counters made monotonic, owners joined, energy attributed."""
        # Kubernetes owners are joined here, once per sample: every output reads them from the rows.
        increases = self._counters.cpu_increases(reading.processes)
        TURNS.give_way()
        container_ids = _container_ids(increases, reading.gpus)
        kube = self.environment.view(self.kube.view(), container_ids, increases, reading.gpus)
        node_gpus = tuple(
            join_owners(self._counters.gpu(gpu, started), kube)
            for gpu in self._number(reading, started)
        )
        TURNS.give_way()
        shown, other_seconds = self._counters.process_seconds(increases)
        self.kube.notice(container_ids)
        energy = self._attribution.update(
            SampleInputs(
                now=started,
                rapl_zones=reading.rapl_zones,
                cpu_times=reading.cpu_times,
                gpus=node_gpus,
                cpu_increases=increases,
                owners=_owners(increases, kube.containers),
            )
        )
        containers = self._containers(increases, kube.containers)
        return Snapshot(
            node=self.config.node_name,
            timestamp=time.time(),
            duration_seconds=time.monotonic() - started,
            interval_seconds=self.config.interval,
            sources=tuple(slot.status() for slot in self.slots),
            gpus=node_gpus,
            processes=shown,
            process_cpu_other=other_seconds,
            process_limit=self.config.process_metrics,
            containers=containers,
            ebpf_programs_attached=reading.ebpf_programs_attached,
            energy=energy,
        )

    def _containers(
        self, increases: Mapping[ProcessLabels, float], pods: Mapping[str, PodRef]
    ) -> tuple[ContainerCpu, ...]:
        """Each container's CPU seconds and its pod."""
        TURNS.give_way()
        return tuple(
            ContainerCpu(container, seconds, pods.get(container, NO_POD))
            for container, seconds in self._counters.containers(increases)
        )


def _container_ids(
    increases: Mapping[ProcessLabels, float], gpus: Iterable[GpuReading]
) -> set[str]:
    """The container ids of a sample's processes, on the CPU and on the devices."""
    found = set(map(_CONTAINER_ID, increases))
    found.update(proc.container_id for gpu in gpus for proc in gpu.processes)
    found.discard("")
    return found


def _owners(
    increases: Mapping[ProcessLabels, float], containers: Mapping[str, PodRef]
) -> dict[ProcessLabels, PodRef]:
    """Each process's owner in the pod list, NO_POD where it names none (only those it names are
    looked at one by one)."""
    owners = dict.fromkeys(increases, NO_POD)
    if containers:
        found = list(map(containers.get, map(_CONTAINER_ID, increases)))
        named = compress(zip(increases, found), found)  # only the pairs with an owner
        owners.update(cast(Iterable[tuple[ProcessLabels, PodRef]], named))
    return owners


def _attribution_settings(config: Config) -> dict[str, Any]:
    return {
        "cpu_tdp_watts": config.cpu_tdp_watts,
        "gpu_idle_watts": config.gpu_idle_watts,
        "process_limit": config.process_metrics,
        "grace": config.process_grace,
        "max_processes": config.max_processes,
    }


def join_owners(gpu: GpuReading, kube: KubeView) -> GpuReading:
    """The reading with the containers holding it (and each MIG device) and each process's
    owner; the very reading, and the very rows, where these are already theirs."""
    if not kube.containers and not kube.devices and _unowned(gpu):
        return gpu  # outside Kubernetes: nobody holds it, no process has an owner
    instances = tuple(
        replaced(instance, holders=kube.mig_holders(instance)) for instance in gpu.mig_instances
    )
    if all(map(is_, instances, gpu.mig_instances)):
        instances = gpu.mig_instances
    held = replaced(gpu, holders=kube.holders(gpu), mig_instances=instances)
    fallbacks = _single_holders(held)
    processes = tuple(_owned(proc, kube, fallbacks) for proc in gpu.processes)
    if all(map(is_, processes, gpu.processes)):
        return held
    return replaced(held, processes=processes)


def _unowned(gpu: GpuReading) -> bool:
    """Whether neither the reading nor its MIG devices have holders and no process an owner."""
    return (
        not gpu.holders
        and not any(map(_HOLDERS, gpu.mig_instances))
        and all(map(is_, map(_OWNER, gpu.processes), repeat(NO_POD)))
    )


def _owned(proc: GpuProcess, kube: KubeView, fallbacks: Mapping[int | None, PodRef]) -> GpuProcess:
    """The process with its owner. Its own container decides. One in a container the pod list
    does not name, or one the agent cannot see in /proc (no comm: another pid namespace), gets
    the one holder of its MIG device, else of the GPU; a host process none."""
    owner = kube.containers.get(proc.container_id) if proc.container_id else None
    if owner is None and (proc.container_id or not proc.comm):
        owner = fallbacks.get(proc.pid, fallbacks.get(None))
    return replaced(proc, owner=NO_POD if owner is None else owner)


def _single_holders(gpu: GpuReading) -> dict[int | None, PodRef]:
    """pid -> the one holder of the MIG device it runs in; None -> the GPU's one holder."""
    found: dict[int | None, PodRef] = {}
    if gpu.holder is not None:
        found[None] = gpu.holder.owner
    for instance in gpu.mig_instances:
        if len(instance.holders) == 1:
            found.update(dict.fromkeys(instance.pids, instance.holders[0].owner))
    return found
