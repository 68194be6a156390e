"""One setting: its row of the table (`Setting`) and how its value as written becomes a value.

A value is written on a flag, in a variable or in the config file. Each parser returns the
value or raises ValueError; ConfigError then names the setting and what it accepts, in one line.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import shlex
import shutil
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# As Go's time.ParseDuration: ASCII digits, micro as "us", the micro sign or the Greek mu; summed
# in nanoseconds, so "100000us" is 0.1 s exactly.
_UNIT_NS = {"ns": 1, "us": 1e3, "µs": 1e3, "μs": 1e3, "ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
# Linux's highest pid_max: no node has more processes than this.
MAX_PIDS = 1 << 22

# A value in an error line: nested lists and long strings are cut, so the line stays short.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 120, 120


def one_line(text: str) -> str:
    """The text with line breaks and other control characters escaped: it prints as one line."""
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode() for char in text
    )


class ConfigError(Exception):
    """A setting has a value that is not accepted; the CLI exits 2 with this one line."""

    def __init__(self, setting: str, value: object, accepted: str, origin: str = "") -> None:
        where = f" (from {origin})" if origin else ""
        super().__init__(one_line(f"bad setting {setting}={_SHORT.repr(value)}{where}: {accepted}"))


@dataclass(frozen=True)
class Setting:
    """One setting: its config-file key, flag, environment names, parser and default."""

    key: str
    envs: tuple[str, ...]
    parse: Callable[[object], Any]
    default: Any
    accepted: str
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


_SETTING = "setting"


def setting(
    envs: tuple[str, ...],
    parser: Callable[[object], Any],
    default: Any,
    accepted: str,
    help: str,
    aliases: tuple[str, ...] = (),
) -> dict[str, Setting]:
    """The metadata that makes a dataclass field a setting; its key is the field's name."""
    return {_SETTING: Setting("", envs, parser, default, accepted, help, aliases)}


def settings_of(table: type[DataclassInstance]) -> tuple[Setting, ...]:
    """The settings of a dataclass, in field order: its fields with setting metadata."""
    return tuple(
        dataclasses.replace(item.metadata[_SETTING], key=item.name)
        for item in dataclasses.fields(table)
        if _SETTING in item.metadata
    )


def number(value: object) -> float:
    """A finite number given as int, float or text of ASCII digits; bools, nan and infinities
    are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    if isinstance(value, str) and not value.isascii():  # float() reads any script's digits
        raise ValueError
    try:
        result = float(value)
    except OverflowError:
        raise ValueError from None
    if not math.isfinite(result):
        raise ValueError
    return result


def duration(value: object) -> float:
    """Go-style duration (`500ms`, `1m30s`) or a plain number of seconds, as seconds."""
    if not isinstance(value, str):
        return number(value)
    written = value.strip()
    try:
        return number(written)
    except ValueError:
        pass
    pos, nanoseconds = 0, 0.0
    while pos < len(written):
        match = _DURATION_PART.match(written, pos)
        if not match:
            raise ValueError
        nanoseconds += float(match.group(1)) * _UNIT_NS[match.group(2)]
        pos = match.end()
    total = nanoseconds / 1e9
    if not written or not math.isfinite(total):
        raise ValueError
    return total


def bounded(parse: Callable[[object], float], low: float, high: float) -> Callable[[object], float]:
    """A parser that accepts what `parse` accepts, from low to high."""

    def parse_bounded(value: object) -> float:
        result = parse(value)
        if not low <= result <= high:
            raise ValueError
        return result

    return parse_bounded


def listen(value: object) -> tuple[str, int]:
    """HOST:PORT (HOST may be an IP address, in brackets for IPv6, a name, or empty: every
    address) as (host, port)."""
    host, sep, port_text = printable(value).rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
        raise ValueError
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        return host, int(port_text)
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ValueError from None
    return host, int(port_text)


def name_list(value: object) -> tuple[str, ...]:
    """Names (of sources or metric prefixes) from a list or a comma list; blanks dropped."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(item, str) for item in value):
            raise ValueError
        items = value
    else:
        items = printable(value).split(",")
    names = tuple(item.strip() for item in items if item.strip())
    if not all(re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:.-]*", name) for name in names):
        raise ValueError
    return names


def count(value: object) -> int:
    """A whole number >= 0 in decimal digits, as int or text (no bool, float, sign, underscore)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError
    written = str(value).strip()
    if not re.fullmatch(r"[0-9]+", written):
        raise ValueError
    return int(written)


def printable(value: object) -> str:
    """Text as written, blanks around removed (a whole number reads as its digits); no control
    characters."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError
    written = str(value).strip()
    if not written.isprintable():
        raise ValueError
    return written


def argv(value: object) -> tuple[str, ...]:
    """An executable and its arguments: a list (config file) or a string split like a shell would
    (flag, env)."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(item, str) and "\0" not in item for item in value):
            raise ValueError
        result = tuple(value)
    else:
        result = tuple(shlex.split(printable(value)))
    if result and shutil.which(result[0]) is None:
        raise ValueError
    return result


def one_of(*choices: str) -> Callable[[object], str]:
    """A parser that accepts exactly one of `choices`."""

    def parse_choice(value: object) -> str:
        written = printable(value)
        if written not in choices:
            raise ValueError
        return written

    return parse_choice


watts = bounded(number, 0, 100_000)


def optional_watts(value: object) -> float | None:
    """Watts, or None for an empty value."""
    return None if isinstance(value, str) and value.strip() == "" else watts(value)


def process_metrics(value: object) -> int | None:
    """off -> 0 series, all -> None (no limit), top:N -> N."""
    written = printable(value)
    if written in ("off", "all"):
        return 0 if written == "off" else None
    match = re.fullmatch(r"top:([0-9]{1,7})", written)
    if not match or not 1 <= int(match.group(1)) <= MAX_PIDS:
        raise ValueError
    return int(match.group(1))


def url(value: object) -> str:
    """An http(s) URL without its trailing slashes, or empty."""
    written = printable(value).rstrip("/")
    if written and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", written):
        raise ValueError
    return written


def flag(value: object) -> bool:
    """A boolean, or true/false, 1/0, yes/no, on/off in any case."""
    if isinstance(value, bool):
        return value
    written = printable(value).lower()
    if written not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError
    return written in ("true", "1", "yes", "on")


# What --simulate-fault can make a simulated accelerator do (sources/simulated.py).
SIMULATED_FAULTS = ("stuck", "cooling", "memory_leak", "frozen_sensor")


def simulated_fault(value: object) -> tuple[str, float] | None:
    """KIND@DURATION (the fault, and how long after the start it begins), or None for empty."""
    written = printable(value)
    if not written:
        return None
    kind, at, after = written.partition("@")
    if kind not in SIMULATED_FAULTS or not at:
        raise ValueError
    return kind, bounded(duration, 0, 86400)(after)
