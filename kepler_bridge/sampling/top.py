"""Per-process families bounded by `process_metrics`.

The N series with the highest values are shown, the rest go to "other".
Totals never decrease, so while the keys stay the same the new top N is
among the last one and the keys that grew: a sample ranks only those; when
keys come or go, only the keys with at least the N-th highest total of those.
"""

from __future__ import annotations

from itertools import compress, filterfalse, repeat
from operator import ge
from typing import Callable, Generic, Hashable, Iterable, Mapping, TypeVar

from kepler_bridge.model import top

K = TypeVar("K", bound=Hashable)
L = TypeVar("L")
R = TypeVar("R")


class TopCounter(Generic[K]):
    """One counter family limited to the top N keys by total.

    A key's series counts from the sample it entered the top N and the increases of the
    keys not shown go to "other", so none decreases and together they gain it all."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.other: float | None = None  # None until a key is left out
        self._offsets: dict[K, float] = {}
        self._shown: list[K] = []
        # The limit and keys of the last full ranking, and each key's place in them.
        self._ranked: tuple[int | None, list[K], dict[K, int] | None] | None = None

    def update(
        self, totals: Mapping[K, float], increases: Mapping[K, float]
    ) -> list[tuple[K, float]]:
        """(key, series value) of the shown keys, highest total first; `increases` needs only the
        keys that grew, and no total may be lower than at the last update.

        `other` then holds the rest."""
        if self.limit == 0:
            return []
        self._shown = shown = self._top(totals, increases)
        last = self._offsets
        offsets = {
            key: last[key] if key in last else totals[key] - increases.get(key, 0.0)
            for key in shown
        }
        if self.other is None and len(totals) > len(shown):
            self.other = 0.0
        if self.other is not None:
            self.other += sum(
                map(increases.__getitem__, filterfalse(offsets.__contains__, increases))
            )
        self._offsets = offsets
        return [(key, totals[key] - offsets[key]) for key in shown]

    def _top(self, totals: Mapping[K, float], increases: Mapping[K, float]) -> list[K]:
        """`top(totals, limit)`: while the keys are those of the last update, in the same order,
        only the keys shown then and those that grew are ranked."""
        keys, ranked = list(totals), self._ranked
        if ranked is None or ranked[0] != self.limit or self.limit is None:
            self._ranked = (self.limit, keys, None)
            return top(totals, self.limit)
        if ranked[1] != keys:
            self._ranked = (self.limit, keys, None)
            return self._reranked(totals, increases, keys, self.limit)
        place = ranked[2]
        if place is None:  # the keys stayed: their places, worked out once for as long
            place = dict(zip(keys, range(len(keys))))
            self._ranked = (self.limit, keys, place)
        candidates = dict.fromkeys(self._shown)
        candidates.update(dict.fromkeys(increases))
        # By total, highest first, equal totals in their place: two sorts in C, the second stable.
        by_place = sorted(candidates, key=place.__getitem__)
        return sorted(by_place, key=totals.__getitem__, reverse=True)[: self.limit]

    def _reranked(
        self, totals: Mapping[K, float], increases: Mapping[K, float], keys: list[K], limit: int
    ) -> list[K]:
        """`top(totals, limit)` after keys came or went. The N-th highest total of any N keys is
        at most the N-th highest of all, so the top N are among the keys with at least that total
        of the last shown keys and those that grew: only those are ranked, in `totals`' order."""
        candidates = dict.fromkeys(filter(totals.__contains__, self._shown))
        candidates.update(dict.fromkeys(increases))
        if len(candidates) < limit:
            return top(totals, limit)
        least = sorted(map(totals.__getitem__, candidates), reverse=True)[limit - 1]
        chosen = compress(keys, map(ge, totals.values(), repeat(least)))
        return sorted(chosen, key=totals.__getitem__, reverse=True)[:limit]

    @property
    def offsets(self) -> Mapping[K, float]:
        """The shown keys and what each total had when its series started, for the saved state."""
        return self._offsets

    def restore(self, other: float | None, offsets: Mapping[K, float]) -> None:
        """Take `other` and `offsets` as a previous worker saved them."""
        self.other, self._offsets = other, dict(offsets)
        self._ranked = None

    def restart(self, key: K) -> None:
        """Start the key's series again: its labels changed, so its old series ended."""
        self._offsets.pop(key, None)


class ShownRows(Generic[K, L, R]):
    """The rows of the keys a family showed last: a key shown again with the very same labels
    object and the same value gets its last row back, not a new record (most processes used
    nothing since the last sample)."""

    def __init__(self) -> None:
        self._last: dict[K, tuple[L, float, R]] = {}

    def rows(
        self,
        shown: Iterable[tuple[K, float]],
        labels: Callable[[K], L],
        make: Callable[[L, float], R],
    ) -> list[R]:
        """A row per (key, value) of `shown`, in its order: `make(labels(key), value)` where the
        key's labels or value changed."""
        last: dict[K, tuple[L, float, R]] = self._last
        kept: dict[K, tuple[L, float, R]] = {}
        rows = []
        for key, value in shown:
            label = labels(key)
            known = last.get(key)
            if known is None or known[0] is not label or known[1] != value:
                known = (label, value, make(label, value))
            kept[key] = known
            rows.append(known[2])
        self._last = kept
        return rows
