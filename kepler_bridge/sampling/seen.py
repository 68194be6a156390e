"""The records a source hands again from one sample to the next, known clean by identity, so the
sanitiser looks only at the new ones."""

from __future__ import annotations

from itertools import compress
from operator import is_not, not_
from typing import Any


class Seen:
    """The records of one class found clean, for the classes whose records sources keep from one
    sample to the next: those of the last call that brought new ones, or moved them. It holds
    them, so no id it knows is reused while it knows it, and nothing older: a replaced or dropped
    record is let go at the next such call, not kept with the generations of a busy host."""

    def __init__(self) -> None:
        self._last: list[Any] = []  # the records known clean, in the order they came
        self._ids: set[int] = set()  # and their ids
        self._call: list[Any] = []
        # Of the last call when it had as many records as the known: the known ones it does not
        # hold in place, and its own records in those places.
        self._swap: tuple[list[Any], list[Any]] | None = None

    def unknown(self, records: list[Any]) -> list[Any]:
        """Those of `records` not known clean."""
        # Sources keep their rows in order, so a record mostly stands where it stood: compared
        # in place (in C), and only those that moved or changed are looked up by id.
        last, moved, self._swap = self._last, records, None
        if len(records) == len(last):
            places = list(map(is_not, records, last))
            moved = list(compress(records, places))
            self._swap = (list(compress(last, places)), moved)
        if not moved:
            return []
        fresh = list(compress(moved, map(not_, map(self._ids.__contains__, map(id, moved)))))
        self._call = records
        if not fresh:  # only moved: known from here on where they stand now
            self.add()
        return fresh

    def add(self) -> None:
        """The records of the last `unknown` call are all clean: they are what is known now."""
        if self._swap is None:
            self._ids = set(map(id, self._call))
        else:  # only the records in the places that changed: some, of thousands
            self._ids.difference_update(map(id, self._swap[0]))
            self._ids.update(map(id, self._swap[1]))
        self._last, self._call, self._swap = self._call, [], None
