"""The counter state on disk: `StateFile` writes it whole now and then and, between those, what
each save changed as one line appended to a log beside it; `load` reads the file and replays the
log. `carry.py` holds the state's tables and the checks that rebuild objects from it."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from kepler_bridge.sampling import carry

log = logging.getLogger(__name__)

FILE = "sampler-state.json"
LOG = "sampler-state.log"  # what the saves since the whole one in FILE changed, a line each
VERSION = 1
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class StateFile:
    """The state saved in `directory`: whole in FILE, with LOG started afresh beside it; each
    save after that appends what it changed to LOG as one line, until LOG outgrows FILE and the
    next save is whole again. A save that raises leaves the two as they were or the line torn
    (`load` ignores a torn line)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._log: int | None = None  # LOG's descriptor; None: the next save is whole
        self._whole_bytes = self._log_bytes = 0
        self._written: carry.Written = {}

    def save(self, state: dict[str, Any]) -> None:
        if self._log is None or self._log_bytes > self._whole_bytes:
            self._save_whole(state)
            return
        parts: list[str] = []
        if not carry.changes_into(state, parts, self._written, ()):
            return
        parts.append("\n")
        line = "".join(parts).encode()
        try:
            written = os.write(self._log, line)
        except BaseException:
            self.close()
            raise
        self._log_bytes += written
        if written != len(line):
            self.close()
            raise OSError(f"{written} of {len(line)} bytes appended to {LOG}")

    def discard(self) -> None:
        """Remove the saved state (OSError when it cannot be): after a failed save it is older
        than what was served, and counters restarting from zero are a reset Prometheus handles,
        where going back is not. The next save is whole."""
        self.close()
        _unlink(os.path.join(self.directory, FILE))
        _unlink(os.path.join(self.directory, LOG))

    def close(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def _save_whole(self, state: dict[str, Any]) -> None:
        """Replace FILE, then LOG with one holding only FILE's generation (a LOG of another
        generation is not replayed on it)."""
        self.close()
        generation = time.monotonic_ns()  # never the same twice on this host, in any worker
        written: carry.Written = {}
        parts: list[str] = []
        whole = {"version": VERSION, "generation": generation, **state}
        carry.encode_into(whole, parts, written, ())
        data = "".join(parts).encode()
        _replace(self.directory, FILE, data)
        header = carry.dumps({"generation": generation}).encode() + b"\n"
        self._log = _replace(self.directory, LOG, header, keep=True)
        self._whole_bytes, self._log_bytes, self._written = len(data), len(header), written


def _replace(directory: str, name: str, data: bytes, keep: bool = False) -> int | None:
    """Replace file `name` atomically: a reader sees the old or the new file, never a part. The
    partial file is created afresh (never through a link, never one already there) and is
    removed when this fails. `keep`: the new file's descriptor, open to append, is returned."""
    path = os.path.join(directory, name)
    partial = f"{path}.{os.getpid()}"
    flags = CREATE | os.O_APPEND if keep else CREATE
    try:
        descriptor = os.open(partial, flags, 0o600)
    except FileExistsError:  # left by a killed worker of the same pid, or put there
        os.unlink(partial)
        descriptor = os.open(partial, flags, 0o600)
    try:
        if os.write(descriptor, data) != len(data):
            raise OSError(f"a short write of {partial}")
        os.replace(partial, path)
    except BaseException:
        os.close(descriptor)
        _unlink(partial)
        raise
    if keep:
        return descriptor
    os.close(descriptor)
    return None


def load(directory: str) -> dict[str, Any] | None:
    """The state the previous worker saved, its log replayed, or None when there is none or it
    is not ours (with one warning: counters restart from zero). Partial files of killed workers
    are removed."""
    _remove_partials(directory)
    try:
        state = json.loads(_read(directory, FILE))
        if not isinstance(state, dict) or state.get("version") != VERSION:
            raise carry.BadState(f"not a version {VERSION} state")
        generation = state.pop("generation", None)
        try:
            lines = _read(directory, LOG).split(b"\n")[:-1]  # the last piece: torn, or none
        except FileNotFoundError:
            lines = []
        if lines and json.loads(lines[0]) == {"generation": generation}:
            _replay(state, lines[1:])
        return state
    except FileNotFoundError:
        return None
    except Exception as err:  # not JSON, too deep, too big, a link: whatever it is, not ours
        log.warning(
            "counter state in %s unreadable, counters restart from zero: %s", directory, err
        )
        return None


def _read(directory: str, name: str) -> bytes:
    descriptor = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
    with open(descriptor, "rb", closefd=True) as file:
        return file.read()


TableRows = tuple[dict[str, Any], str, int, dict[tuple[Any, ...], list[Any]]]


def _replay(state: dict[str, Any], lines: list[bytes]) -> None:
    """Apply the log's lines to the state loaded from FILE, in order."""
    tables: dict[tuple[int, str], TableRows] = {}  # each table's rows by key, while replaying
    for line in lines:
        _apply(state, json.loads(line), tables)
    for parent, name, _, rows in tables.values():
        parent[name] = list(rows.values())


def _apply(
    state: dict[str, Any], changes: object, tables: dict[tuple[int, str], TableRows]
) -> None:
    if not isinstance(changes, dict):
        raise carry.BadState(f"a change of the state is a {type(changes).__name__}, not an object")
    for name, value in changes.items():
        current = state.get(name)
        if isinstance(value, dict) and carry.KEY_CELLS in value:
            cells, gone, changed = value[carry.KEY_CELLS], value[carry.GONE], value[carry.CHANGED]
            table = tables.get((id(state), name))
            if table is None:
                if not isinstance(current, list) or type(cells) is not int or cells < 1:
                    raise carry.BadState(f"{name}: changes of a table that is none")
                keyed = {tuple(row[:cells]): row for row in current}
                table = tables[(id(state), name)] = (state, name, cells, keyed)
            if cells != table[2] or not isinstance(gone, list) or not isinstance(changed, list):
                raise carry.BadState(f"{name}: changes of another table")
            rows = table[3]
            for key in gone:
                rows.pop(tuple(key), None)
            rows.update((tuple(row[:cells]), row) for row in changed)
        elif isinstance(value, dict) or isinstance(current, dict):
            if not (isinstance(value, dict) and isinstance(current, dict)):
                raise carry.BadState(f"{name}: an object changed into a value, or a value into one")
            _apply(current, value, tables)
        else:
            state[name] = value


def _remove_partials(directory: str) -> None:
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith((f"{FILE}.", f"{LOG}.")):
            try:
                _unlink(os.path.join(directory, name))
            except OSError:
                pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
