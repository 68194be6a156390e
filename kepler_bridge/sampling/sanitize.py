"""Readings as they enter the snapshot.

Whatever a source returns (a plug-in's too), the exporters only see finite, non-negative
numbers, whole numbers where the contract counts, and text that encodes as UTF-8 and holds no
escape sequence or control character.

A value that fails is dropped, never clamped: it reads as "cannot report". A record without
a value it cannot do without (a process without a pid) is dropped whole.

Most readings need no change. Each rule has a check (checks.py) that tells, for one field of many
records at once and mostly in C, whether the rule would leave every value as it is. The records of
a tuple are cleaned a field at a time: a field whose check passes is kept as it came, and only the
values of the other fields go through the rule one by one.

Records are frozen, so one that passed stays clean: the process rows a CPU source keeps from one
sample to the next (ProcessTable's) are checked once, then known by identity (`Seen`).
"""

from __future__ import annotations

import dataclasses
import numbers
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable

from kepler_bridge.model import (
    MAX_DEVICES,
    MAX_EXACT,
    NO_POD,
    CpuTimes,
    GpuProcess,
    GpuReading,
    MigInstance,
    NvLink,
    ProcessCpu,
    RaplZone,
    SourceReading,
    replaced,
)
from kepler_bridge.printable import label_text
from kepler_bridge.sampling import checks
from kepler_bridge.sampling.checks import Check
from kepler_bridge.sampling.seen import Seen
from kepler_bridge.sources import ranges

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A rule takes a field's value as the source gave it; None means the value is dropped.
_Rule = Callable[[Any], Any]
# (field name, rule, whether the record needs the field, check, getter) for each field of a record.
_Plan = tuple[tuple[str, _Rule, bool, Check, Callable[[Any], Any]], ...]
# The fields of a record by annotation: (check, getter of all their values, the fields' plan).
_Groups = tuple[tuple[Check, Callable[[Any], Any], _Plan], ...]


def reading(value: Any) -> SourceReading:
    """The source's reading with every unusable value dropped.

    Raises for a wrong type or for more than MAX_DEVICES devices."""
    if not isinstance(value, SourceReading):
        raise TypeError(
            f"read() returned {type(value).__name__}, not a SourceReading; fix the source"
        )
    if len(value.gpus) > MAX_DEVICES:
        raise ValueError(
            f"{len(value.gpus)} devices, more than {MAX_DEVICES} per source: "
            "the source is refused; report only real accelerators"
        )
    return _records((value,), SourceReading)[0]


def _as_float(value: Any) -> float | None:
    """A real number (not a bool) as a float; None for anything else or beyond a float."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def real(value: Any) -> float | None:
    """A number from 0 to 2**53 as a float, else None (NaN, infinities, negatives, non-numbers)."""
    number = _as_float(value)
    return number if number is not None and 0 <= number < MAX_EXACT else None


def _within(low: float, high: float) -> tuple[_Rule, bool, Check]:
    """The rule of a reading with a physical range (model.Ratio, Celsius...): a number from `low`
    to `high` as a float, else None."""

    def rule(value: Any) -> float | None:
        number = _as_float(value)
        return number if number is not None and low <= number <= high else None  # NaN: neither

    return rule, False, checks.numbers(float, True, low, high)


def whole(value: Any) -> int | None:
    """A whole number from 0 to 2**53 (a fraction rounded down), else None."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
        if not isinstance(value, numbers.Integral):
            number = real(value)
            return None if number is None else int(number)
        value = int(value)
    return value if 0 <= value < MAX_EXACT else None


def flag(value: Any) -> bool | None:
    """A yes/no value: a bool as it is, else None."""
    return value if isinstance(value, bool) else None


def _xid_code(code: Any) -> str | int | None:
    """An XID code: a whole number, or text such as "other"."""
    return utf8_text(code) if isinstance(code, str) else whole(code)


def utf8_text(value: Any) -> str:
    """A label value: str as it is when printable, '' for None.

    Escape sequences and control characters are stripped (`printable`), lone surrogates become
    '?'."""
    if type(value) is not str:
        value = "" if value is None else str(value)
    return label_text(value)


def _items(rule: _Rule, check: Check) -> Callable[[Any], tuple]:
    """A rule for a tuple field: each element through rule, the dropped (None) ones left out;
    `check` is the rule's check for the elements."""

    def clean(values: Any) -> tuple:
        if type(values) is tuple and check(list(values)):
            return values
        if not isinstance(values, (tuple, list)):
            raise TypeError(f"expected a tuple, got {type(values).__name__}; fix the source")
        cleaned = tuple(rule(value) for value in values)
        # Unchanged only where no element was dropped: a None element maps to None, itself.
        if type(values) is tuple and all(
            new is old and new is not None for new, old in zip(cleaned, values)
        ):
            return values
        return tuple(new for new in cleaned if new is not None)

    return clean


def _pair(first: _Rule, second: _Rule) -> Callable[[Any], tuple | None]:
    def clean(pair: Any) -> tuple | None:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return None
        new = (first(pair[0]), second(pair[1]))
        if None in new:
            return None
        return pair if new[0] is pair[0] and new[1] is pair[1] else new

    return clean


def _record(value: Any, cls: type[DataclassInstance]) -> Any:
    """A dataclass record with each field through its rule.

    None when a required field is unusable."""
    if not isinstance(value, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(value).__name__}; fix the source")
    changes = {}
    for name, rule, required, _, _ in _PLANS[cls]:
        old = getattr(value, name)
        new = rule(old)
        if new is None and required:
            return None
        if new is not old:
            changes[name] = new
    return replaced(value, **changes) if changes else value


def _unchanged(records: list[Any], cls: type[DataclassInstance]) -> bool:
    """Whether every one of `records` is a `cls` that its rules keep as it is."""
    seen = _SEEN.get(cls)
    fresh = records if seen is None else seen.unknown(records)  # those known are `cls` records
    if not fresh:  # every check passes no values (the tuple fields of most readings are empty)
        return True
    if not {cls}.issuperset(map(type, fresh)):
        return False
    if not all(check(getter(fresh)) for check, getter, _ in _GROUPS[cls]):
        return False
    if seen is not None and fresh:
        seen.add()
    return True


def _records(values: Any, cls: type[DataclassInstance]) -> tuple:
    """A tuple of `cls` records, each with its fields through their rules, those without a value
    they need left out."""
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"expected a tuple, got {type(values).__name__}; fix the source")
    if not {cls}.issuperset(map(type, values)):
        return _one_by_one(values, cls)
    try:
        changes = _changes(values, cls)
    except Exception:
        return _one_by_one(values, cls)  # raises what the rules raise, record by record
    if not changes and type(values) is tuple:
        return values
    kept = []
    for position, record in enumerate(values):
        change = changes.get(position, {})
        if change is not None:
            kept.append(replaced(record, **change) if change else record)
    return tuple(kept)


def _changes(records: Any, cls: type[DataclassInstance]) -> dict[int, dict[str, Any] | None]:
    """Position of a record -> what its rules change (None: a value it needs is unusable), for
    the records that change; the rules of a field run only where its check fails."""
    found: dict[int, dict[str, Any] | None] = {}
    for group_check, values, plan in _GROUPS[cls]:
        if group_check(values(records)):
            continue
        for name, rule, required, check, getter in plan:
            column = list(map(getter, records))
            if len(plan) > 1 and check(column):  # another field of the group failed
                continue
            for position, old in enumerate(column):
                changes = found.get(position, {})
                if changes is None:
                    continue
                new = rule(old)
                if new is None and required:
                    found[position] = None
                elif new is not old:
                    found[position] = {**changes, name: new}
    return found


def _one_by_one(values: Any, cls: type[DataclassInstance]) -> tuple:
    """`_records` the slow way: every rule on every value, in order."""
    cleaned = tuple(_record(value, cls) for value in values)
    # Unchanged only where no record was dropped: a None element maps to None, itself.
    if type(values) is tuple and all(
        new is old and new is not None for new, old in zip(cleaned, values)
    ):
        return values
    return tuple(new for new in cleaned if new is not None)


def _nested(cls: type[DataclassInstance]) -> tuple[_Rule, bool, Check]:
    """The rule, and its check, of a tuple of `cls` records."""
    return (
        lambda values: _records(values, cls),
        False,
        lambda values: checks.tuples(values) and _unchanged(list(chain.from_iterable(values)), cls),
    )


def _unique_pids(processes: tuple) -> bool:
    return len(processes) < 2 or len(set(map(_PID, processes))) == len(processes)


def _first_of_each_pid(processes: tuple) -> tuple:
    """A device's processes with each pid once, its first row: two rows of one pid would be two
    series of one name and labels, which a scrape refuses, and two shares of its energy."""
    if _unique_pids(processes):
        return processes
    rows: dict[int, GpuProcess] = {}
    for row in processes:
        rows.setdefault(row.pid, row)
    return tuple(rows.values())


def _device_processes() -> tuple[_Rule, bool, Check]:
    """The rule, and its check, of a device's processes: clean records, each pid once."""
    rule, required, check = _nested(GpuProcess)
    return (
        lambda values: _first_of_each_pid(rule(values)),
        required,
        lambda values: check(values) and all(map(_unique_pids, values)),
    )


def _optional(cls: type[DataclassInstance]) -> tuple[_Rule, bool, Check]:
    return (
        lambda value: None if value is None else _record(value, cls),
        False,
        lambda values: _unchanged(list(filter(checks.present, values)), cls),
    )


def _tuple_of(rule: _Rule, check: Check) -> tuple[_Rule, bool, Check]:
    """A tuple field of values that `rule` and `check` take one by one."""
    return (_items(rule, check), False, checks.each(check))


def _pairs(first: tuple[_Rule, Check], second: tuple[_Rule, Check]) -> tuple[_Rule, bool, Check]:
    """A tuple field of (first, second) pairs, a pair dropped when either of its values is."""
    return _tuple_of(_pair(first[0], second[0]), checks.pairs(first[1], second[1]))


def _constant(value: Any) -> tuple[_Rule, bool, Check]:
    """A field the sampler sets after this check: what a source put there becomes `value`."""
    return (lambda _: value, False, checks.constant(value))


# Checks of values that must be there: required fields, tuple elements and pair values.
_REAL, _WHOLE = checks.REAL, checks.WHOLE
_PID = attrgetter("pid")
_TEXT, _FLAG = (utf8_text, checks.texts), (bool, checks.kinds(bool))


# Field annotation (as written in model.py) -> (rule, whether the record needs it, check).
# A new annotation must get a rule here: the plans below refuse to build without one.
# Under `from __future__ import annotations` dataclasses give the annotation as text.
_RULES: dict[str | type, tuple[_Rule, bool, Check]] = {
    "float | None": (real, False, checks.numbers(float, True)),
    "Ratio": _within(0.0, 1.0),
    "FanRatio": _within(0.0, 2.0),
    "Celsius": _within(ranges.MIN_CELSIUS, ranges.MAX_CELSIUS),
    "Watts": _within(0.0, ranges.MAX_WATTS),
    "Hertz": _within(1.0, ranges.MAX_HERTZ),
    "int | None": (whole, False, checks.numbers(int, True)),
    "float": (real, True, _REAL),
    "int": (whole, True, _WHOLE),
    "str": (utf8_text, False, checks.texts),
    "bool": (bool, False, checks.kinds(bool)),
    "tuple[str, ...]": _tuple_of(utf8_text, checks.texts),
    "tuple[tuple[str, bool], ...]": _pairs(_TEXT, _FLAG),
    "tuple[tuple[str, float], ...]": _pairs(_TEXT, (real, _REAL)),
    "tuple[tuple[int | str, int], ...]": _pairs((_xid_code, checks.xid_codes), (whole, _WHOLE)),
    "tuple[GpuProcess, ...]": _device_processes(),
    "tuple[GpuReading, ...]": _nested(GpuReading),
    "tuple[ProcessCpu, ...]": _nested(ProcessCpu),
    "tuple[RaplZone, ...]": _nested(RaplZone),
    "bool | None": (flag, False, checks.kinds(bool, checks.NONE)),
    "tuple[tuple[str, int], ...]": _pairs(_TEXT, (whole, _WHOLE)),
    "tuple[NvLink, ...]": _nested(NvLink),
    "tuple[int, ...]": _tuple_of(whole, _WHOLE),
    "tuple[MigInstance, ...]": _nested(MigInstance),
    "CpuTimes | None": _optional(CpuTimes),
    # Kubernetes owners, which the sampler joins after this check:
    # what a source put there is dropped.
    "PodRef": _constant(NO_POD),
    "tuple[Holder, ...]": _constant(()),
}


def _plan(cls: type[DataclassInstance]) -> _Plan:
    missing = [
        f"{field.name}: {field.type}"
        for field in dataclasses.fields(cls)
        if field.type not in _RULES
    ]
    if missing:
        raise TypeError(
            "kepler_bridge.sampling.sanitize has no rule for "
            f"{cls.__name__} field(s) {missing}; add one"
        )
    return tuple(
        (field.name, *_RULES[field.type], attrgetter(field.name))
        for field in dataclasses.fields(cls)
    )


def _groups(plan: _Plan) -> _Groups:
    """The fields of a plan grouped by their check, each group's values read in one go."""
    by_check: dict[Check, list[str]] = {}
    for name, _, _, check, _ in plan:
        by_check.setdefault(check, []).append(name)
    return tuple(
        (check, checks.column(names), tuple(field for field in plan if field[0] in names))
        for check, names in by_check.items()
    )


_PLANS: dict[type[DataclassInstance], _Plan] = {
    cls: _plan(cls)
    for cls in (
        SourceReading,
        GpuReading,
        GpuProcess,
        ProcessCpu,
        RaplZone,
        CpuTimes,
        NvLink,
        MigInstance,
    )
}
_GROUPS = {cls: _groups(plan) for cls, plan in _PLANS.items()}
# The records sources keep from one sample to the next: ProcessTable's rows, and the rows of the
# nvml source's GPU processes (a row whose values did not change is the last read's). (A class
# whose records are new at every read only pays for remembering them.)
_SEEN: dict[type, Seen] = {ProcessCpu: Seen(), GpuProcess: Seen()}
