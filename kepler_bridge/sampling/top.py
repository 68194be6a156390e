"""Per-process families bounded by `process_metrics`.

The N series with the highest values are shown, the rest go to "other".
"""

from __future__ import annotations

from typing import Generic, Hashable, Mapping, TypeVar

from kepler_bridge.model import top

K = TypeVar("K", bound=Hashable)


class TopCounter(Generic[K]):
    """One counter family limited to the top N keys by total.

    A key's series counts from the sample it entered the top N and the increases of the
    keys not shown go to "other", so none decreases and together they gain it all."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.other: float | None = None  # None until a key is left out
        self._offsets: dict[K, float] = {}

    def update(
        self, totals: Mapping[K, float], increases: Mapping[K, float]
    ) -> list[tuple[K, float]]:
        """(key, series value) of the shown keys, highest total first.

        `other` then holds the rest."""
        if self.limit == 0:
            return []
        shown = top(totals, self.limit)
        offsets = {
            key: self._offsets[key]
            if key in self._offsets
            else totals[key] - increases.get(key, 0.0)
            for key in shown
        }
        if self.other is None and len(totals) > len(shown):
            self.other = 0.0
        if self.other is not None:
            self.other += sum(value for key, value in increases.items() if key not in offsets)
        self._offsets = offsets
        return [(key, totals[key] - offsets[key]) for key in shown]

    @property
    def offsets(self) -> Mapping[K, float]:
        """The shown keys and what each total had when its series started, for the saved state."""
        return self._offsets

    def restore(self, other: float | None, offsets: Mapping[K, float]) -> None:
        """Take `other` and `offsets` as a previous worker saved them."""
        self.other, self._offsets = other, dict(offsets)
