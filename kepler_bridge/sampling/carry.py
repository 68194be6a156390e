"""Counter state carried from a crashed worker to the next one within one agent run.

The gunicorn master makes a private directory (mode 0700, on tmpfs where
/dev/shm exists) and removes it when it exits; the worker's sampler writes
its state there after every sample and a new worker reads it back, so
counters continue instead of restarting from zero. The state is JSON of
plain numbers and strings: the worker rebuilds its objects from it and
checks every value (the helpers below), so a crafted file cannot run code
and a bad one is a clean restart from zero. A table with a row per process
is a `Table`, which keeps each row encoded: a save encodes only the rows
that changed since the one before; a small list that seldom changes (the
offsets of the shown series) is a `Rows`, kept encoded while it stays.
`state_file.py` writes and reads it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
import time
from itertools import compress, count, repeat
from operator import is_
from typing import Any, Callable, Generic, Iterable, Mapping, TypeVar, cast

from kepler_bridge.sources import pid_namespace

log = logging.getLogger(__name__)

# tmpfs first: the state is rewritten every sample and must not outlive the agent.
PLACES = ("/dev/shm", None)
PREFIX = "kepler-bridge-"
MASTER = b"/kepler_bridge/http/supervisor.py"  # the master's script, in its command line
# An empty command line is read again this many times, so long apart (see `_agent_running`).
CMDLINE_READS = 3
CMDLINE_RETRY_SECONDS = 0.01
# A state directory: the prefix, the pid of the master that made it, the inode of that master's
# pid namespace, mkdtemp's suffix.
DIRECTORY = re.compile(re.escape(PREFIX) + r"([0-9]+)-([0-9]+)-")
K = TypeVar("K", bound=tuple[Any, ...])  # a table key: its row's first cells
dumps = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
_ROW = "{},{}]"  # a row's head (its comma, "[" and cells) and its encoded tail numbers
# A log line's object for a Table: its key's cell count, the keys removed, the rows changed.
KEY_CELLS, GONE, CHANGED = "~key", "~gone", "~rows"


class BadState(ValueError):
    """The saved state is not what this agent writes: counters restart from zero."""


def own_cells(key: K) -> K:
    """The head of a `Table` row whose key is its first cells: the key itself."""
    return key


def make_dir() -> str:
    """A new private directory for the state, named after the master's pid, once the ones of
    masters that no longer run are removed.

    '' (with a warning) where none can be made."""
    problems, places = [], []
    for place in PLACES:
        try:
            found = place or tempfile.gettempdir()
            if _others_may_swap(found):
                problems.append(f"{found}: others may write it and it lacks the sticky bit")
                continue
            places.append(found)
        except OSError as err:  # gettempdir: no writable temporary directory at all
            problems.append(f"{place or '$TMPDIR'}: {err.strerror or err}")
    for place in places:
        remove_stale_dirs(place)
    for place in places:
        try:
            return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{_namespace_id()}-", dir=place)
        except OSError as err:
            problems.append(f"{place}: {err.strerror or err}")
    log.warning(
        "no directory for counter state (%s): counters restart from zero if the worker restarts; "
        "make /dev/shm or $TMPDIR writable",
        "; ".join(problems),
    )
    return ""


def _others_may_swap(place: str) -> bool:
    """Whether others may rename what is in `place`: writable by all without the sticky bit. A
    state directory there could be swapped for a link to any directory, which the agent (root)
    would then write and empty."""
    mode = os.stat(place).st_mode
    return bool(mode & stat.S_IWOTH) and not mode & stat.S_ISVTX


def remove_stale_dirs(place: str) -> None:
    """Delete the state directories in `place` that a killed master left: ours (same owner, a
    real directory), made in this pid namespace, and named after a pid that is gone, is no
    kepler-bridge process, or is this one's (a restarted container's master often has the pid of
    the one before). A master of another pid namespace (another pod sharing the directory) has
    pids this one cannot see, so its directories are left alone."""
    try:
        names = os.listdir(place)
    except OSError:
        return
    own = _namespace_id()
    for name in names:
        found = DIRECTORY.match(name)
        if found is None or found.group(2) != own:
            continue
        pid, path = int(found.group(1)), os.path.join(place, name)
        if pid != os.getpid() and _agent_running(pid):
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            log.info("removing %s: the agent that made it no longer runs", path)
            shutil.rmtree(path, ignore_errors=True)


def _namespace_id() -> str:
    """The inode number of this process's pid namespace; '0' where it cannot be read."""
    return "".join(filter(str.isdigit, pid_namespace.namespace())) or "0"


def _agent_running(pid: int) -> bool:
    """Whether `pid` is a running kepler-bridge (the script, `python -m kepler_bridge`, or the
    master it becomes: `python -S .../kepler_bridge/http/supervisor.py`)."""
    for _ in range(CMDLINE_READS):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                argv = file.read().split(b"\0")
        except OSError:
            return False
        if argv != [b""]:
            break
        # Empty: a kernel thread, or a process in the middle of execve (`serve` becoming the
        # master), whose new command line is there a moment later.
        time.sleep(CMDLINE_RETRY_SECONDS)
    return (
        any(os.path.basename(arg) == b"kepler-bridge" for arg in argv[:2])
        or argv[1:3] == [b"-m", b"kepler_bridge"]
        or (len(argv) > 2 and argv[2].endswith(MASTER))
    )


def remove_dir(directory: str) -> None:
    """Delete the state directory and what it holds."""
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


class Table(Generic[K]):
    """A list of rows in the state, one per key (a tuple: a row's first cells), each kept encoded.
    A row is the key's `head` cells (encoded when the key first shows up, or again once
    `relabelled`), then its tail numbers (at least one; ints or finite floats), encoded for the
    keys `changed` since the last save: `tails` gives those of a list of keys, one tuple per key."""

    def __init__(
        self,
        head: Callable[[K], Iterable[Any]],
        tails: Callable[[list[K]], Iterable[tuple[Any, ...]]],
    ) -> None:
        self._head_of, self._tails_of = head, tails
        self._text: dict[K, str] = {}
        self._cut: dict[K, int] = {}  # where a row's head ends in its text; none once relabelled
        self._changed: dict[K, None] = {}  # in the order the keys changed first: the rows' order
        self._gone: dict[K, None] = {}  # removed since the last save
        self._key_cells = 0  # cells of a key, once one was encoded

    def changed(self, keys: Iterable[K]) -> None:
        self._changed.update(dict.fromkeys(keys))

    def relabelled(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._cut.pop(key, None)
            self._changed[key] = None

    def removed(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._cut.pop(key, None)
            if self._text.pop(key, None) is not None:
                self._gone[key] = None
            self._changed.pop(key, None)

    def clear(self) -> None:
        self._cut.clear()
        self._text.clear()
        self._changed.clear()
        self._gone.clear()

    def pending(self) -> bool:
        """Whether a row changed or went since the last save."""
        return bool(self._changed or self._gone)

    def encode_into(self, parts: list[str]) -> None:
        """Append the rows as a JSON list to `parts`, one piece per row: the text is copied once,
        when the whole state is joined."""
        self._encode_changed()
        self._gone.clear()
        _rows_into(parts, self._text.values())

    def changes_into(self, parts: list[str]) -> None:
        """Append what changed since the last save as a log line's object: the key's cell count,
        the keys removed and the rows changed or added, in the rows' order."""
        changed = self._encode_changed()
        gone = [list(key) for key in self._gone]
        self._gone.clear()
        parts += ('{"', KEY_CELLS, '":', str(self._key_cells), ',"', GONE, '":', dumps(gone))
        parts += (',"', CHANGED, '":')
        _rows_into(parts, map(self._text.__getitem__, changed))
        parts.append("}")

    def _encode_changed(self) -> list[K]:
        """Encode the rows of the keys changed since the last save; those keys."""
        cut, text, changed = self._cut, self._text, list(self._changed)
        if changed:
            # The tails in one go: "[[1.5,2],[3.0,4]]"; numbers only, so "],[" parts them.
            tails = dumps(list(self._tails_of(changed)))[2:-2].split("],[")
            # The heads from the rows' texts: a head kept apart would double a table's memory.
            ends = list(map(cut.get, changed))
            found = [None if end is None else text[key][:end] for key, end in zip(changed, ends)]
            for at in compress(count(), map(is_, found, repeat(None))):  # new or relabelled
                found[at] = "," + dumps(list(self._head_of(changed[at])))[:-1]
            heads = cast(list[str], found)  # every one found or made
            cut.update(zip(changed, map(len, heads)))
            text.update(zip(changed, map(_ROW.format, heads, tails)))
            self._changed.clear()
            self._key_cells = len(changed[0])
        return changed


def _rows_into(parts: list[str], rows: Iterable[str]) -> None:
    """Append encoded rows (each starting with its comma) to `parts` as one JSON list."""
    start = len(parts)
    parts += rows
    if len(parts) > start:
        parts[start] = "[" + parts[start][1:]
    else:
        parts.append("[")
    parts.append("]")


class Rows:
    """The rows [*key, value] of a mapping, kept as JSON while the mapping holds the very keys and
    values it held, in the same order (the offsets of the shown series, which seldom change)."""

    def __init__(self) -> None:
        self._keys: list[tuple[Any, ...]] = []
        self._values: list[float] = []
        self._text = "[]"

    def of(self, mapping: Mapping[tuple[Any, ...], float]) -> Rows:
        """These rows, for the state: encoded again where the mapping changed."""
        keys, values = list(mapping), list(mapping.values())
        if not (
            len(keys) == len(self._keys)
            and all(map(is_, keys, self._keys))
            and all(map(is_, values, self._values))
        ):
            self._text = dumps([[*key, value] for key, value in zip(keys, values)])
            self._keys, self._values = keys, values
        return self

    @property
    def text(self) -> str:
        """The rows as JSON."""
        return self._text


def encode(state: dict[str, Any]) -> str:
    """The state as JSON text: plain data, with each Table and Rows as the list of its rows."""
    # Pieces joined once: the tables' rows (most of the text) are copied once, not at each level.
    parts: list[str] = []
    encode_into(state, parts, {}, ())
    return "".join(parts)


Written = dict[tuple[str, ...], str]  # the text of each plain value and Rows as last saved


def encode_into(
    state: dict[str, Any], parts: list[str], written: Written, path: tuple[str, ...]
) -> None:
    parts.append("{")
    for name, value in state.items():
        parts += (dumps(name), ":")
        if isinstance(value, Table):
            value.encode_into(parts)
        elif isinstance(value, dict):
            encode_into(value, parts, written, (*path, name))
        else:
            text = _text_of(value)
            written[(*path, name)] = text
            parts.append(text)
        parts.append(",")
    if state:
        parts.pop()  # the comma after the last
    parts.append("}")


def _text_of(value: Any) -> str:
    """A plain value's JSON, or a Rows' kept JSON."""
    return value.text if isinstance(value, Rows) else dumps(value)


def changes_into(
    state: dict[str, Any], parts: list[str], written: Written, path: tuple[str, ...]
) -> bool:
    """Append an object of what changed in `state` since the last save (the tables' changes, the
    other values that are not what was written last); False, and nothing appended, if nothing."""
    start = len(parts)
    parts.append("{")
    for name, value in state.items():
        if isinstance(value, Table):
            if value.pending():
                parts += (dumps(name), ":")
                value.changes_into(parts)
                parts.append(",")
        elif isinstance(value, dict):
            mark = len(parts)
            parts += (dumps(name), ":")
            if changes_into(value, parts, written, (*path, name)):
                parts.append(",")
            else:
                del parts[mark:]
        else:
            text = _text_of(value)
            if written.get((*path, name)) != text:
                written[(*path, name)] = text
                parts += (dumps(name), ":", text, ",")
    if len(parts) == start + 1:
        del parts[start:]
        return False
    parts[-1] = "}"  # the comma after the last
    return True


# Checks for rebuilding objects from a loaded state; each raises BadState on a wrong type.


def text(value: object) -> str:
    if not isinstance(value, str):
        raise BadState(f"expected a string, got {type(value).__name__}")
    return value


def integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadState(f"expected a whole number, got {type(value).__name__}")
    return value


def number(value: object) -> float:
    """An int or a float from 0 up, kept as it is: every number the state holds is a count, an
    amount or a clock reading (JSON's NaN and Infinity, which json.loads takes, are none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadState(f"expected a number, got {type(value).__name__}")
    if not 0 <= value < math.inf:
        raise BadState(f"expected a finite number from 0 up, got {value!r}")
    return value


def optional_number(value: object) -> float | None:
    return None if value is None else number(value)


def code(value: object) -> int | str:
    """An XID code: a number, or a name such as "other"."""
    return value if isinstance(value, str) else integer(value)


def field(state: object, name: str) -> Any:
    """One field of a mapping in the state."""
    if not isinstance(state, dict) or name not in state:
        raise BadState(f"missing {name!r}")
    return state[name]


def rows(value: object, *cells: Callable[[object], Any]) -> list[tuple[Any, ...]]:
    """A list of rows, each a list of len(cells) values passed through its cell's check."""
    if not isinstance(value, list):
        raise BadState(f"expected a list, got {type(value).__name__}")
    checked = []
    for row in value:
        if not isinstance(row, list) or len(row) != len(cells):
            raise BadState(f"expected rows of {len(cells)} values")
        checked.append(tuple(check(cell) for check, cell in zip(cells, row)))
    return checked
