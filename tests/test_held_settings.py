"""The master's settings file: each worker reads the last whole record a worker wrote."""

from __future__ import annotations

import os
import pickle

from kepler_bridge.http import held_settings


def test_a_worker_reads_the_last_settings_written_and_the_file_stays_small() -> None:
    fd = held_settings.create(("start", {"config": "a"}, {}))
    try:
        assert held_settings.read(fd) == ("start", {"config": "a"}, {})
        largest = 0
        for number in range(50):
            settings = (f"reload {number}", {}, {"cert": b"x" * (number * 7 % 40)})
            held_settings.write(fd, settings)
            assert held_settings.read(fd) == settings
            largest = max(largest, len(pickle.dumps(settings)))
            assert os.fstat(fd).st_size <= held_settings.HEADER.size + 3 * largest
    finally:
        os.close(fd)


def test_a_worker_killed_while_writing_leaves_the_record_before_current() -> None:
    """Its record is whole before the header names it: stop the write at any byte."""
    fd = held_settings.create(("start", {}, {}))
    try:
        held_settings.write(fd, ("reloaded", {}, {}))
        at, length = held_settings.HEADER.unpack(os.pread(fd, held_settings.HEADER.size, 0))
        new_record = b"\x80\x04garbage that is not whole"
        place = held_settings.HEADER.size
        if place + len(new_record) > at:
            place = at + length
        os.pwrite(fd, new_record, place)  # killed before the header moved
        assert held_settings.read(fd) == ("reloaded", {}, {})
    finally:
        os.close(fd)
