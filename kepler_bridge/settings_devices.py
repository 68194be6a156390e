"""The settings of how the agent learns which container holds which device, after the settings
table's (settings_table.py is at the module size limit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kepler_bridge import settings_parse as parse
from kepler_bridge.settings_table import SettingsTable


@dataclass(frozen=True)
class DevicesTable(SettingsTable):
    """The settings table with the device-assignment rows appended."""

    device_environment: bool = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_DEVICE_ENVIRONMENT",),
            parse.flag,
            True,
            "expected on or off",
            "where pod-resources gives no answer (KubeEdge), learn each container's devices "
            "from its processes' /proc/<pid>/environ; off: read no other process's environment",
        )
    )
