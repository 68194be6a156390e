"""Simulated accelerators for demos and dashboards: seedable, time-varying, physically plausible."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from kepler_bridge.model import GpuProcess, GpuReading, SourceReading, replaced
from kepler_bridge.sources.base import Source

GIB = 1024**3
COMMS = ("python3", "tritonserver", "ollama", "trtexec", "ffmpeg")


@dataclass
class _SimGpu:
    """State of one simulated accelerator."""

    period: float
    phase: float
    memory_total: int
    idle_watts: float
    max_watts: float
    temperature: float = 0.0  # start() sets it: settled at the load of the wave
    energy: float = 0.0


class SimulatedSource(Source):
    """N fake accelerators whose utilization follows a wave, power follows utilization, heat
    follows power."""

    name = "simulated"

    def start(self) -> None:
        rng = random.Random(self.config.simulate_seed)
        self.rng = rng
        self.gpus = [
            _SimGpu(
                period=rng.uniform(60, 300),
                phase=rng.uniform(0, 2 * math.pi),
                memory_total=rng.choice((16, 24, 40, 80)) * GIB,
                idle_watts=rng.uniform(40, 70),
                max_watts=rng.uniform(250, 400),
            )
            for _ in range(self.config.simulate)
        ]
        self.pids = [
            [rng.randint(2000, 60000) for _ in range(rng.randint(1, 3))] for _ in self.gpus
        ]
        wall = time.time()
        for gpu in self.gpus:  # long at work: as warm as its load makes it, not heating up
            gpu.temperature = _settled(_power(gpu, _wave(gpu, wall)))
        self.last = self.started = time.monotonic()
        self.frozen: GpuReading | None = None

    def read(self) -> SourceReading:
        now = time.monotonic()
        elapsed, self.last = now - self.last, now
        wall = time.time()
        gpus = [self._read_one(i, gpu, wall, elapsed) for i, gpu in enumerate(self.gpus)]
        fault = self.config.simulate_fault
        if gpus and fault is not None and now - self.started >= fault[1]:
            gpus[0] = self._faulty(gpus[0], fault[0], now - self.started - fault[1])
        return SourceReading(gpus=tuple(gpus))

    def _faulty(self, gpu: GpuReading, kind: str, since: float) -> GpuReading:
        """The first accelerator with --simulate-fault's fault, `since` seconds after it began."""
        if kind == "stuck":  # a spinning kernel: busy, drawing next to nothing
            idle = self.gpus[0].idle_watts
            return replaced(gpu, utilization=1.0, power_watts=round(idle * 1.05, 2))
        if kind == "cooling":  # a failed fan: the same watts, ever more degrees
            hotter = round((gpu.temperature_celsius or 0.0) + min(35.0, since), 1)
            return replaced(gpu, temperature_celsius=hotter, fan_speed_ratio=1.0)
        if kind == "memory_leak":
            total = gpu.memory_total_bytes or 0
            used = min(total, (gpu.memory_used_bytes or 0) + int(since * 50e6))
            return replaced(gpu, memory_used_bytes=used, memory_free_bytes=total - used)
        self.frozen = self.frozen or gpu  # frozen_sensor: the readings of the fault's start
        return replaced(
            gpu,
            power_watts=self.frozen.power_watts,
            temperature_celsius=self.frozen.temperature_celsius,
            utilization=self.frozen.utilization,
        )

    def _read_one(self, index: int, gpu: _SimGpu, wall: float, elapsed: float) -> GpuReading:
        wave = _wave(gpu, wall)
        util = min(1.0, max(0.0, wave + self.rng.uniform(-0.03, 0.03)))
        power = _advance(gpu, util, elapsed)
        used = int(gpu.memory_total * (0.2 + 0.6 * wave))
        return GpuReading(
            index=index,
            uuid=f"SIM-{self.config.simulate_seed:04d}-{index:04d}",
            vendor="simulated",
            model="Simulated Accelerator",
            driver_version="sim-1.0",
            pci_bus_id=f"00000000:{index + 1:02X}:00.0",
            utilization=util,
            memory_utilization=util * 0.6,
            encoder_utilization=0.0,
            decoder_utilization=0.0,
            memory_used_bytes=used,
            memory_total_bytes=gpu.memory_total,
            memory_free_bytes=gpu.memory_total - used,
            temperature_celsius=round(gpu.temperature, 1),
            memory_temperature_celsius=round(gpu.temperature + 4, 1),
            power_watts=round(power, 2),
            power_limit_watts=round(gpu.max_watts, 0),
            energy_joules=gpu.energy,
            sm_clock_hertz=(600 + 1200 * util) * 1e6,
            memory_clock_hertz=1593e6,
            fan_speed_ratio=min(1.0, 0.3 + max(0.0, gpu.temperature - 40) / 50),
            pcie_transmit_bytes_per_second=util * 2e9,
            pcie_receive_bytes_per_second=util * 6e9,
            performance_state=0 if util > 0.1 else 8,
            throttled=(
                ("gpu_idle", util < 0.05),
                ("sw_power_cap", power > 0.95 * gpu.max_watts),
                ("hw_thermal_slowdown", False),
                ("sw_thermal_slowdown", gpu.temperature > 85),
            ),
            ecc_corrected_total=0,
            ecc_uncorrected_total=0,
            processes=_processes(self.pids[index], index, util, used),
        )


def _wave(gpu: _SimGpu, wall: float) -> float:
    """The load the GPU's wave asks for at Unix time `wall`, 0.05 to 0.95."""
    return 0.5 + 0.45 * math.sin(2 * math.pi * wall / gpu.period + gpu.phase)


def _power(gpu: _SimGpu, util: float) -> float:
    return gpu.idle_watts + (gpu.max_watts - gpu.idle_watts) * util


def _settled(power: float) -> float:
    """The temperature a GPU drawing `power` watts settles at."""
    return 30.0 + power * 0.15


def _advance(gpu: _SimGpu, util: float, elapsed: float) -> float:
    """The power drawn at this utilization; the GPU's energy and temperature move on by it."""
    power = _power(gpu, util)
    gpu.energy += power * elapsed
    gpu.temperature += (_settled(power) - gpu.temperature) * min(1.0, elapsed / 20.0)
    return power


def _processes(pids: list[int], index: int, util: float, used: int) -> tuple[GpuProcess, ...]:
    """The GPU's processes, sharing its utilization and memory evenly."""
    return tuple(
        GpuProcess(
            pid=pid,
            comm=COMMS[(pid + index) % len(COMMS)],
            memory_used_bytes=used // len(pids),
            utilization=util / len(pids),
        )
        for pid in pids
    )
