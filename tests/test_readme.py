"""The README documents exactly what the code does: its metrics and its settings."""

from __future__ import annotations

import re
from pathlib import Path

from kepler_bridge.config import SETTINGS
from kepler_bridge.exposition.prometheus import METRICS
from kepler_bridge.reload import RELOADABLE

README = (Path(__file__).parent.parent / "README.md").read_text()


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_metric_table_lists_exactly_the_metrics_the_code_can_emit() -> None:
    listed = re.findall(r"^\| `([a-z_]+)` \|", section("Metrics"), re.MULTILINE)
    assert len(listed) == len(set(listed)), "a metric is listed twice"
    assert set(listed) == set(METRICS)


def test_configuration_table_lists_every_setting() -> None:
    table = section("Configuration")
    for setting in SETTINGS:
        assert f"`{setting.flag}`" in table, setting.flag
        assert setting.envs[0] in table or setting.envs[0].rsplit("_", 1)[-1] in table, (
            setting.envs[0]
        )
        assert f"`{setting.key}`" in table, setting.key


def test_the_two_commands_come_first() -> None:
    head = README.split("\n## ", 1)[0]
    assert "make run" in head and "make test" in head


def test_the_reload_section_names_exactly_the_settings_a_reload_applies() -> None:
    listed = section("Configuration").split("These settings apply at once:", 1)[1]
    listed = listed.split("A change of any other setting", 1)[0]
    named = set(re.findall(r"`([a-z_]+)\*?`", listed))
    groups = {"anomaly": "anomaly", "kube_": "kube_"}  # `anomaly*`, the `kube_*` settings
    found = {
        name
        for name in RELOADABLE
        if name in named
        or any(name.startswith(prefix) and stem in named for prefix, stem in groups.items())
    }
    assert found == RELOADABLE, f"not in the README's reload list: {sorted(RELOADABLE - found)}"
    assert named - {"anomaly", "kube_"} <= RELOADABLE, sorted(named - RELOADABLE)
