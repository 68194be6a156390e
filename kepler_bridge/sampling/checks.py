"""Checks of many values at once, mostly in C, for the sanitiser's rules.

A check takes one field's values of many records and says whether its rule
would keep every one of them as it is (the very object); only where a check
fails do the rule's values go through it one by one. A check may say no
where the rule would keep a value, never yes where it would change one.
"""

from __future__ import annotations

from functools import partial
from itertools import chain, repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, Callable

from kepler_bridge.model import MAX_EXACT
from kepler_bridge.printable import MAX_LABEL_CHARS

Check = Callable[[list[Any]], bool]
NONE = type(None)
present = partial(is_not, None)


def numbers(kind: type, optional: bool, low: float = 0, high: float | None = None) -> Check:
    """The check of `real` (kind float) or `whole` (int): each value of that very type (or None,
    where optional), from 0 below MAX_EXACT, no NaN; or, of a physical range's rule, from `low`
    to `high`."""
    kinds = {kind, NONE} if optional else {kind}

    def check(values: list[Any]) -> bool:
        if not kinds.issuperset(map(type, values)):
            return False
        found = list(filter(present, values)) if optional else values
        if not found:
            return True
        top = max(found)
        if not (min(found) >= low and (top < MAX_EXACT if high is None else top <= high)):
            return False
        total = sum(found)  # NaN where any is: in range, the sum of floats is finite
        return total == total

    return check


REAL, WHOLE = numbers(float, False), numbers(int, False)


def kinds(*allowed: type) -> Check:
    """The check of a rule that keeps exactly the values of these types."""
    types = set(allowed)
    return lambda values: types.issuperset(map(type, values))


def texts(values: list[Any]) -> bool:
    """The check of `utf8_text`: str itself, printable, not over MAX_LABEL_CHARS."""
    return (
        {str}.issuperset(map(type, values))
        and all(map(str.isprintable, values))
        and max(map(len, values), default=0) <= MAX_LABEL_CHARS
    )


def xid_codes(values: list[Any]) -> bool:
    """The check of an XID code: a whole number, or text."""
    if not {str, int}.issuperset(map(type, values)):
        return False
    found_texts = [value for value in values if type(value) is str]
    return texts(found_texts) and WHOLE([value for value in values if type(value) is int])


def tuples(values: list[Any]) -> bool:
    return {tuple}.issuperset(map(type, values))


def each(check: Check) -> Check:
    """The check of a tuple field whose elements `check` takes. The tuples of the last call that
    had new ones and passed are known by identity (held, so no id is reused): their elements are
    immutable (text, numbers, pairs of them), and one a source hands again (the same clocks event
    reasons, slow counters carried between reads) is not looked into again."""
    known: dict[int, tuple] = {}

    def checked(values: list[Any]) -> bool:
        nonlocal known
        if not tuples(values):
            return False
        fresh = [value for value in values if known.get(id(value)) is not value]
        if not fresh:
            return True
        if not check(list(chain.from_iterable(fresh))):
            return False
        known = dict(zip(map(id, values), values))
        return True

    return checked


def pairs(first: Check, second: Check) -> Check:
    """The check of (first, second) pairs."""
    return lambda values: (
        tuples(values)
        and {2}.issuperset(map(len, values))
        and first(list(map(itemgetter(0), values)))
        and second(list(map(itemgetter(1), values)))
    )


def constant(value: Any) -> Check:
    """The check of a rule that makes every value `value`: each is that very object."""
    return lambda values: all(map(is_, values, repeat(value)))


def column(names: list[str]) -> Callable[[list[Any]], list[Any]]:
    """The values of these fields of many records, as one list, a record at a time (in C)."""
    if len(names) == 1:
        getter = attrgetter(names[0])
        return lambda records: list(map(getter, records))
    getters = attrgetter(*names)
    return lambda records: list(chain.from_iterable(map(getters, records)))
