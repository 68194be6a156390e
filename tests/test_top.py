"""The top-N families rank only what changed, and show what a full ranking shows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kepler_bridge.model import top
from kepler_bridge.sampling.top import TopCounter


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_shown_keys_are_those_of_a_full_ranking_whatever_comes_or_goes(
    data: st.DataObject,
) -> None:
    """Over samples where keys grow (often by equal steps: ties), come, go or change places, a
    family shows the keys `top` ranks over all totals, in its order."""
    draw = data.draw
    limit = draw(st.integers(1, 5), label="limit")
    family: TopCounter[int] = TopCounter(limit)
    totals = dict.fromkeys(range(draw(st.integers(0, 12))), 0.0)
    for step in range(draw(st.integers(1, 15), label="samples")):
        increases: dict[int, float] = {}
        for key in draw(st.lists(st.sampled_from(range(20)), max_size=8), label="grew"):
            added = draw(st.sampled_from([0.5, 1.0, 2.0]))
            increases[key] = increases.get(key, 0.0) + added
            totals[key] = totals.get(key, 0.0) + added
        change = draw(st.sampled_from(["none", "none", "gone", "came", "moved"]))
        if change == "gone" and totals:
            del totals[draw(st.sampled_from(sorted(totals)))]
        elif change == "came":
            totals.setdefault(draw(st.integers(20, 30)), draw(st.sampled_from([0.0, 1.0, 9.0])))
        elif change == "moved" and totals:
            key = draw(st.sampled_from(sorted(totals)))
            totals[key] = totals.pop(key)
        grew = {key: added for key, added in increases.items() if key in totals}
        shown = [key for key, _ in family.update(totals, grew)]
        assert shown == top(totals, limit), f"sample {step}"
