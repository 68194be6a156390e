"""Readings as they enter the snapshot.

Whatever a source returns (a plug-in's too), the exporters only see finite, non-negative
numbers, whole numbers where the contract counts, and text that encodes as UTF-8 and holds no
escape sequence or control character.

A value that fails is dropped, never clamped: it reads as "cannot report". A record without
a value it cannot do without (a process without a pid) is dropped whole.
"""

from __future__ import annotations

import dataclasses
import numbers
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
)
from kepler_bridge.sources.printable import printable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A rule takes a field's value as the source gave it; None means the value is dropped.
_Rule = Callable[[Any], Any]
# (field name, rule, whether the record needs the field) for each field of a record.
_Plan = tuple[tuple[str, _Rule, bool], ...]


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
    return _record(value, SourceReading)


def real(value: Any) -> float | None:
    """A number from 0 to 2**53 as a float, else None (NaN, infinities, negatives, non-numbers)."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
        try:
            value = float(value)
        except OverflowError:
            return None
    return value if 0 <= value < MAX_EXACT else None


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
    if value.isprintable():  # the common case, checked in C: nothing to strip or replace
        return value
    return printable(value).encode("utf-8", "replace").decode("utf-8")


def _items(rule: _Rule) -> Callable[[Any], tuple]:
    """A rule for a tuple field: each element through rule, the dropped (None) ones left out."""

    def clean(values: Any) -> tuple:
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
    for name, rule, required in _PLANS[cls]:
        old = getattr(value, name)
        new = rule(old)
        if new is None and required:
            return None
        if new is not old:
            changes[name] = new
    return dataclasses.replace(value, **changes) if changes else value


def _nested(cls: type[DataclassInstance]) -> _Rule:
    return lambda value: _record(value, cls)


def _optional(cls: type[DataclassInstance]) -> _Rule:
    return lambda value: None if value is None else _record(value, cls)


# Field annotation (as written in model.py) -> (rule, whether the record needs it).
# A new annotation must get a rule here: the plans below refuse to build without one.
# Under `from __future__ import annotations` dataclasses give the annotation as text.
_RULES: dict[str | type, tuple[_Rule, bool]] = {
    "float | None": (real, False),
    "int | None": (whole, False),
    "float": (real, True),
    "int": (whole, True),
    "str": (utf8_text, False),
    "bool": (bool, False),
    "tuple[str, ...]": (_items(utf8_text), False),
    "tuple[tuple[str, bool], ...]": (_items(_pair(utf8_text, bool)), False),
    "tuple[tuple[str, float], ...]": (_items(_pair(utf8_text, real)), False),
    "tuple[tuple[int | str, int], ...]": (
        _items(_pair(_xid_code, whole)),
        False,
    ),
    "tuple[GpuProcess, ...]": (_items(_nested(GpuProcess)), False),
    "tuple[GpuReading, ...]": (_items(_nested(GpuReading)), False),
    "tuple[ProcessCpu, ...]": (_items(_nested(ProcessCpu)), False),
    "tuple[RaplZone, ...]": (_items(_nested(RaplZone)), False),
    "bool | None": (flag, False),
    "tuple[tuple[str, int], ...]": (_items(_pair(utf8_text, whole)), False),
    "tuple[NvLink, ...]": (_items(_nested(NvLink)), False),
    "tuple[int, ...]": (_items(whole), False),
    "tuple[MigInstance, ...]": (_items(_nested(MigInstance)), False),
    "CpuTimes | None": (_optional(CpuTimes), False),
    # Kubernetes owners, which the sampler joins after this check:
    # what a source put there is dropped.
    "PodRef": (lambda _: NO_POD, False),
    "tuple[Holder, ...]": (lambda _: (), False),
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
    return tuple((field.name, *_RULES[field.type]) for field in dataclasses.fields(cls))


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
