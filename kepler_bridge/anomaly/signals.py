"""Small streaming pieces the detectors share: a condition held for a time, a time-decayed mean."""

from __future__ import annotations


class Hold:
    """A condition that fires once it held for `after` seconds and clears once it was false for
    `clear` seconds: one noisy sample neither raises nor ends an alarm."""

    def __init__(self, after: float, clear: float) -> None:
        self.after = after
        self.clear = clear
        self.firing = False
        self._since: float | None = None
        self._false_since: float | None = None

    def update(self, now: float, condition: bool) -> bool:
        """Whether it fires after this sample."""
        if condition:
            self._false_since = None
            self._since = now if self._since is None else self._since
            self.firing = self.firing or now - self._since >= self.after
        else:
            self._since = None
            if self.firing:
                self._false_since = now if self._false_since is None else self._false_since
                self.firing = now - self._false_since < self.clear
        return self.firing

    def reset(self) -> None:
        """Forget the condition (a gap in the samples)."""
        self.firing = False
        self._since = self._false_since = None


class Ewma:
    """A mean whose weights halve every `half_life` seconds; `weight` is how much time it saw,
    capped at four half-lives, so callers can tell a mean made of minutes from one of hours."""

    def __init__(self, half_life: float, value: float = 0.0) -> None:
        self.half_life = half_life
        self.value = value
        self.seen = 0.0

    def update(self, value: float, elapsed: float) -> float:
        """Take in a value that held for `elapsed` seconds."""
        # The mean's own value again (an error rate of 0, a state that holds) leaves it as it is,
        # whatever the weight: most updates, and no power to work out.
        if value != self.value:
            alpha = 1.0 - 0.5 ** (max(elapsed, 0.0) / self.half_life)
            self.value = value if self.seen == 0 else self.value + alpha * (value - self.value)
        self.seen = min(self.seen + elapsed, 4 * self.half_life)
        return self.value
