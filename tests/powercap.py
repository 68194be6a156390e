"""Fixture RAPL powercap trees laid out like the kernel's, whose counters tests set or advance."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Iterator

REAL_MAX_RANGE_UJ = 262143328850


class PowercapTree:
    """<sysfs>/devices/virtual/powercap/<interface>/<zone>[/<subzone>],
    linked from <sysfs>/class/powercap."""

    def __init__(self, sysfs: Path) -> None:
        self.sysfs = sysfs
        self.classes = sysfs / "class" / "powercap"
        self.classes.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._paths: dict[str, Path] = {}
        self._max: dict[str, int] = {}

    def zone(
        self,
        directory: str,
        name: str,
        energy_uj: int = 0,
        max_energy_range_uj: int = REAL_MAX_RANGE_UJ,
    ) -> None:
        """Add a zone such as ``zone("intel-rapl:0", "package-0")`` or a subzone
        ``("intel-rapl:0:1", "dram")``."""
        interface, _, number = directory.partition(":")
        parent = f"{interface}:{number.split(':')[0]}"
        base = self.sysfs / "devices" / "virtual" / "powercap" / interface
        path = base / parent / directory if directory != parent else base / directory
        path.mkdir(parents=True)
        (path / "name").write_text(name + "\n")
        (path / "max_energy_range_uj").write_text(f"{max_energy_range_uj}\n")
        (base / "enabled").write_text("1\n")
        if not (self.classes / interface).exists():
            (self.classes / interface).symlink_to(base)
        (self.classes / directory).symlink_to(path)
        self._paths[directory], self._max[directory] = path, max_energy_range_uj
        self.set(directory, energy_uj)

    def set(self, directory: str, energy_uj: int) -> None:
        """Write the raw counter atomically, so the agent never reads half a number."""
        path = self._paths[directory] / "energy_uj"
        tmp = path.with_name(f".energy_uj.{threading.get_ident()}")
        tmp.write_text(f"{energy_uj}\n")
        os.replace(tmp, path)

    def get(self, directory: str) -> int:
        return int((self._paths[directory] / "energy_uj").read_text())

    def advance(self, directory: str, joules: float) -> None:
        """Add energy to a zone's counter, wrapping at its max_energy_range_uj like the hardware."""
        with self._lock:
            self.set(
                directory, (self.get(directory) + round(joules * 1e6)) % (self._max[directory] + 1)
            )

    @contextlib.contextmanager
    def drawing(self, directory: str, watts: float, step: float = 0.02) -> Iterator[list[float]]:
        """Advance a zone at `watts` in a thread while the block runs;
        yields [joules added so far]."""
        added = [0.0]
        stop = threading.Event()

        def run() -> None:
            last = time.monotonic()
            while not stop.wait(step):
                now = time.monotonic()
                self.advance(directory, watts * (now - last))
                added[0] += watts * (now - last)
                last = now

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield added
        finally:
            stop.set()
            thread.join()
