"""The settings the master holds for each worker it starts: a memory file that `serve` fills and a
worker rewrites after each reload it takes, so that a worker started after a crash runs the
settings in force, not the start-up ones, even where the config file no longer loads.

The file is a header, the offset and length of the current record, then records (each a pickle
of the settings, the flags and the kept files). A new record never overwrites the current one and
the header moves to it, one 16-byte write, once it is whole: a worker killed while writing leaves
the last record current."""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

HEADER = struct.Struct("<QQ")


def create(settings: tuple[Any, ...]) -> int:
    """A memory file only this process tree holds, holding `settings`: its descriptor."""
    fd = os.memfd_create("kepler-bridge-settings", 0)
    os.pwrite(fd, HEADER.pack(0, 0), 0)
    write(fd, settings)
    return fd


def write(fd: int, settings: tuple[Any, ...]) -> None:
    """Make `settings` the current record: before the current one where it fits there, else after
    it. OSError where the memory file cannot take it; the current record stays."""
    record = pickle.dumps(settings)
    at, length = HEADER.unpack(os.pread(fd, HEADER.size, 0))
    place = HEADER.size if HEADER.size + len(record) <= at else max(at + length, HEADER.size)
    if os.pwrite(fd, record, place) != len(record):
        raise OSError(f"the settings file took part of {len(record)} bytes")
    os.pwrite(fd, HEADER.pack(place, len(record)), 0)
    if place == HEADER.size:
        os.ftruncate(fd, HEADER.size + len(record))


def read(fd: int) -> Any:
    """The current record's settings."""
    at, length = HEADER.unpack(os.pread(fd, HEADER.size, 0))
    return pickle.loads(os.pread(fd, length, at))
