"""benchmarks/scrape_phase.py places scrapes in the samples' busy windows, from made-up scrapes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from scrape_phase import STEPS, Scrape, before_publication, busy_windows  # noqa: E402

OLD = (99.003, 0.002)  # the sample before: its end and length
NEW = (100.003, 0.002)  # the sample whose window the scrapes meet: it starts at 100.001


def test_only_scrapes_answered_before_the_new_snapshot_count_by_their_start_in_the_window() -> None:
    found = [
        Scrape(99.5, 99.5004, *OLD),  # the first scrape of a run is never placed
        Scrape(100.0012, 100.0017, *OLD),  # 0.2 ms into the sample
        Scrape(100.0021, 100.0027, *OLD),  # 1.1 ms into it
        Scrape(100.0205, 100.0209, *OLD),  # 19.5 ms into it: the last row
        Scrape(100.025, 100.0254, *NEW),  # the first to show it: the window ends here
        Scrape(100.5, 100.5004, *NEW),  # outside any window
    ]
    by_offset = before_publication(found, busy_windows(found))
    assert len(by_offset) == STEPS
    placed = {row: latencies for row, latencies in enumerate(by_offset) if latencies}
    assert placed.keys() == {0, 2, STEPS - 1}
    assert placed[0] == [found[1].latency]
    assert placed[2] == [found[2].latency]
    assert placed[STEPS - 1] == [found[3].latency]
