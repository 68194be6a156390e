"""The counter state saved whole now and then and as appended changes between: what `load` reads
back is what the last save held, whatever the saves did in between, a torn line or a log of
another whole save included (generated cases, hypothesis)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kepler_bridge.sampling import carry, state_file

Key = tuple[int, str]


class Workloads:
    """A table of rows [pid, comm, label, number] and the plain values beside it, as a part of
    the agent keeps them: its state goes to `StateFile.save`."""

    def __init__(self) -> None:
        self.rows: dict[Key, tuple[str, float]] = {}
        self.table = carry.Table(self._head, self._tails)
        self.now = 0.0
        self.rarely: list[int] = [1, 2]
        self.offsets = carry.Rows()

    def put(self, key: Key, label: str, number: float) -> None:
        old = self.rows.get(key)
        self.rows[key] = (label, number)
        if old is None or old[0] != label:
            self.table.relabelled([key])
        elif old[1] != number:
            self.table.changed([key])

    def remove(self, key: Key) -> None:
        if self.rows.pop(key, None) is not None:
            self.table.removed([key])

    def state(self) -> dict[str, Any]:
        shown = {key: number for key, (_, number) in list(self.rows.items())[:3]}
        return {
            "now": self.now,
            "part": {"rows": self.table, "rarely": self.rarely},
            "offsets": self.offsets.of({(*key, 0): value for key, value in shown.items()}),
        }

    def _head(self, key: Key) -> tuple[Any, ...]:
        return (*key, self.rows[key][0])

    def _tails(self, keys: list[Key]) -> list[tuple[float]]:
        return [(self.rows[key][1],) for key in keys]


def loaded(directory: Path) -> dict[str, Any] | None:
    found = state_file.load(str(directory))
    if found is not None:
        assert found.pop("version") == state_file.VERSION
    return found


def current(workloads: Workloads) -> dict[str, Any]:
    """The state as a whole save would write it now (every change is saved already)."""
    return json.loads(carry.encode(workloads.state()))


KEYS = st.tuples(st.integers(1, 12), st.sampled_from(["a", "b"]))
STEP = st.one_of(
    st.tuples(st.just("put"), KEYS, st.sampled_from(["", "x", "y"]), st.integers(0, 3)),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("tick")),
    st.tuples(st.just("rarely"), st.integers(0, 2)),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(saves=st.lists(st.lists(STEP, max_size=8), min_size=1, max_size=40))
def test_what_is_loaded_is_what_the_last_save_held(tmp_path: Path, saves: list) -> None:
    for path in tmp_path.iterdir():
        path.unlink()
    workloads, saver = Workloads(), state_file.StateFile(str(tmp_path))
    wholes = 0
    for steps in saves:
        for step in steps:
            if step[0] == "put":
                workloads.put(step[1], step[2], float(step[3]))
            elif step[0] == "remove":
                workloads.remove(step[1])
            elif step[0] == "tick":
                workloads.now += 1.0
            else:
                workloads.rarely = [step[1]]
        inode = os.stat(tmp_path / state_file.FILE).st_ino if wholes else None
        saver.save(workloads.state())
        wholes += inode != os.stat(tmp_path / state_file.FILE).st_ino
        assert loaded(tmp_path) == current(workloads)
    saver.close()
    assert len(saves) < 10 or wholes < len(saves), "every save was whole: no log was replayed"


def many(count: int) -> Workloads:
    workloads = Workloads()
    for pid in range(count):
        workloads.put((pid, "sleeper"), "container", 0.0)
    return workloads


def test_a_save_appends_only_what_changed(tmp_path: Path) -> None:
    workloads, saver = many(1000), state_file.StateFile(str(tmp_path))
    saver.save(workloads.state())
    whole = (tmp_path / state_file.FILE).stat().st_size
    for second in range(1, 4):
        before = (tmp_path / state_file.LOG).stat().st_size
        workloads.now = float(second)
        workloads.put((7, "sleeper"), "container", float(second))
        saver.save(workloads.state())
        line = (tmp_path / state_file.LOG).read_bytes()[before:]
        assert json.loads(line) == {
            "now": float(second),
            "part": {
                "rows": {"~key": 2, "~gone": [], "~rows": [[7, "sleeper", "container", second]]}
            },
        }
    assert whole > 30_000 and len(line) < 100
    assert loaded(tmp_path) == current(workloads)


def test_the_log_is_folded_into_a_whole_save_once_it_outgrows_it(tmp_path: Path) -> None:
    workloads, saver = many(20), state_file.StateFile(str(tmp_path))
    sizes = []
    for second in range(200):
        workloads.now = float(second)
        workloads.put((second % 20, "sleeper"), "container", float(second))
        saver.save(workloads.state())
        sizes.append((tmp_path / state_file.LOG).stat().st_size)
    whole = (tmp_path / state_file.FILE).stat().st_size
    assert max(sizes) <= 2 * whole, "the log grew past twice the whole state"
    assert sizes.count(min(sizes)) > 3, "no whole save started the log afresh"
    assert loaded(tmp_path) == current(workloads)


def test_a_torn_last_line_is_left_out(tmp_path: Path) -> None:
    workloads, saver = many(5), state_file.StateFile(str(tmp_path))
    saver.save(workloads.state())
    workloads.put((1, "sleeper"), "moved", 1.0)
    saver.save(workloads.state())
    before = current(workloads)
    size = (tmp_path / state_file.LOG).stat().st_size
    workloads.put((2, "sleeper"), "moved", 2.0)
    saver.save(workloads.state())
    saver.close()
    with open(tmp_path / state_file.LOG, "r+b") as log:
        log.truncate(size + 10)  # a worker killed in the middle of its write
    assert loaded(tmp_path) == before


def test_a_log_of_another_whole_save_is_not_replayed(tmp_path: Path) -> None:
    """A worker killed between replacing the whole state and starting its log leaves the log of
    the whole save before: its changes are older than the new whole state."""
    workloads, saver = many(5), state_file.StateFile(str(tmp_path))
    saver.save(workloads.state())
    workloads.put((1, "sleeper"), "old", 1.0)
    saver.save(workloads.state())
    older_log = (tmp_path / state_file.LOG).read_bytes()
    workloads.put((1, "sleeper"), "new", 2.0)
    new_worker = state_file.StateFile(str(tmp_path))
    new_worker.save(workloads.state())  # its first save is whole
    (tmp_path / state_file.LOG).write_bytes(older_log)
    assert loaded(tmp_path) == current(workloads)


@pytest.mark.parametrize(
    "line",
    [
        b"[]",
        b'{"part":{"rows":{"~key":2,"~gone":5,"~rows":[]}}}',
        b'{"part":{"rows":{"~key":2,"~gone":[],"~rows":[7]}}}',
        b'{"part":{"rows":{"~key":"2","~gone":[],"~rows":[]}}}',
        b'{"now":{"rows":{"~key":2,"~gone":[],"~rows":[]}}}',
        b'{"part":{"rows":{"~key":2,"~gone":[[[1]]],"~rows":[]}}}',
        b'{"part":{"rows":{"~key":2}}}',
        b"{" * 100_000,
    ],
)
def test_a_crafted_log_line_is_a_clean_restart_with_one_warning(
    tmp_path: Path, line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    workloads, saver = many(3), state_file.StateFile(str(tmp_path))
    saver.save(workloads.state())
    saver.close()
    with open(tmp_path / state_file.LOG, "ab") as log:
        log.write(line + b"\n")
    with caplog.at_level(logging.WARNING):
        assert state_file.load(str(tmp_path)) is None
    assert [r for r in caplog.records if "counters restart from zero" in r.getMessage()]


def test_a_discarded_state_leaves_no_file_and_the_next_save_is_whole(tmp_path: Path) -> None:
    workloads, saver = many(3), state_file.StateFile(str(tmp_path))
    saver.save(workloads.state())
    saver.save(workloads.state())
    saver.discard()
    assert list(tmp_path.iterdir()) == []
    workloads.now = 5.0
    saver.save(workloads.state())
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == sorted([state_file.FILE, state_file.LOG])
    assert loaded(tmp_path) == current(workloads)
