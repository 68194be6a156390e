"""Registry of sources: the one place that names them all."""

from __future__ import annotations

import importlib

from kepler_bridge.config import Config
from kepler_bridge.sources.base import Source

# name -> "module:Class"; imported lazily so the gunicorn master stays small.
REGISTRY: dict[str, str] = {
    "nvml": "kepler_bridge.sources.nvml:NvmlSource",
    "simulated": "kepler_bridge.sources.simulated:SimulatedSource",
}

# `auto` tries each group in order; within a group the first alternative that
# starts wins and the ones before it are reported down with their reason.
# `simulated` joins when --simulate > 0.
AUTO: tuple[tuple[str, ...], ...] = (("nvml",),)


def source_class(name: str) -> type[Source]:
    """Import and return the class registered under name."""
    module_name, _, class_name = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def selected_groups(config: Config) -> tuple[list[tuple[str, ...]], bool]:
    """Groups of alternative source names this config asks for, and whether `auto` picked them."""
    auto = "auto" in config.sources
    groups = list(AUTO) if auto else []
    chosen = {name for group in groups for name in group}
    for name in config.sources:
        if name != "auto" and name not in chosen:
            groups.append((name,))
            chosen.add(name)
    if config.simulate and "simulated" not in chosen:
        groups.append(("simulated",))
    return groups, auto
