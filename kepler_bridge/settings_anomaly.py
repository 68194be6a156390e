"""The settings of the anomaly detectors and of the simulated faults they are shown with: the
settings table's last rows, after DevicesTable's (`SettingsTable` is at its size limit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kepler_bridge import settings_parse as parse
from kepler_bridge.settings_devices import DevicesTable


@dataclass(frozen=True)
class AnomalyTable(DevicesTable):
    """The settings table with the anomaly rows after the others."""

    simulate_fault: tuple[str, float] | None = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_SIMULATE_FAULT",),
            parse.simulated_fault,
            "",
            f"expected KIND@DURATION with KIND one of {', '.join(parse.SIMULATED_FAULTS)}, "
            "such as cooling@5m, or empty",
            "make the first simulated accelerator fail this way, this long after the start "
            "(to see the anomaly detectors, alerts and dashboards at work)",
        )
    )
    anomaly: bool = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_ANOMALY",),
            parse.flag,
            True,
            "expected true or false",
            "run the anomaly detectors (gpu_anomaly, gpu_anomaly_score) in their own thread",
        )
    )
    anomaly_window: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_ANOMALY_WINDOW",),
            parse.bounded(parse.duration, 60, 86400),
            "1h",
            "expected a duration from 1m to 24h, such as 1h",
            "history each device's IsolationForest is fitted on (at most 720 samples of it kept)",
        )
    )
    anomaly_refit: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_ANOMALY_REFIT",),
            parse.bounded(parse.duration, 10, 86400),
            "30m",
            "expected a duration from 10s to 24h, such as 30m",
            "how often the IsolationForests are fitted again on the window",
        )
    )
    anomaly_sensitivity: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_ANOMALY_SENSITIVITY",),
            parse.bounded(parse.number, 0.25, 4),
            1.0,
            "expected a number from 0.25 to 4, such as 1",
            "divides every detector's margin: 2 alarms at half the deviation, 0.5 at twice it",
        )
    )
