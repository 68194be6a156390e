"""The process's effective capabilities, as /proc tells them."""

from __future__ import annotations

SYS_ADMIN, SYS_NICE, PERFMON, BPF = 1 << 21, 1 << 23, 1 << 38, 1 << 39


def effective(procfs: str = "/proc") -> int | None:
    """This process's effective capability set (CapEff in /proc/self/status) as a bit mask; None
    where it cannot be read."""
    try:
        with open(f"{procfs}/self/status", encoding="ascii", errors="replace") as file:
            return next(int(line.split()[1], 16) for line in file if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
