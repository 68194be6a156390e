"""Registry of sources: the one place that names them all.

Built-ins are listed here; other packages add sources through the entry-point
group ``kepler_bridge.sources`` (entry-point name = source name, value =
``module:Class``). Both are looked up and imported the same way, by
``available()``, ``source_class()`` and ``make_source()``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from importlib.metadata import entry_points

from kepler_bridge.config import Config, ConfigError
from kepler_bridge.model import SourceReading
from kepler_bridge.sources.base import Source, SourceUnavailable

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kepler_bridge.sources"

# name -> "module:Class"; imported lazily so the gunicorn master stays small.
REGISTRY: dict[str, str] = {
    "nvml": "kepler_bridge.sources.nvml.source:NvmlSource",
    "simulated": "kepler_bridge.sources.simulated:SimulatedSource",
    "ebpf": "kepler_bridge.sources.ebpf.source:EbpfSource",
    "procfs": "kepler_bridge.sources.procfs:ProcfsSource",
    "rapl": "kepler_bridge.sources.rapl:RaplSource",
    "amdgpu": "kepler_bridge.sources.amdgpu:AmdgpuSource",
    "intel": "kepler_bridge.sources.intel:IntelSource",
    "jetson": "kepler_bridge.sources.jetson:JetsonSource",
    "ascend": "kepler_bridge.sources.ascend:AscendSource",
    "command": "kepler_bridge.sources.command:CommandSource",
}

# `auto` tries each group in order; within a group the first alternative that
# starts wins and the ones before it stand by (state "standby", or "absent"), with their reason.
# Plug-ins whose class says `auto = True` follow; `command` joins when --command is set,
# `simulated` when --simulate > 0. The order is the order of node-wide device indexes.
CPU_TIME = ("ebpf", "procfs")  # the sources of processes' CPU time: the first that starts
AUTO: tuple[tuple[str, ...], ...] = (
    ("nvml",),
    ("amdgpu",),
    ("intel",),
    ("jetson",),
    ("ascend",),
    CPU_TIME,
    ("rapl",),
)


@functools.cache
def plugins() -> dict[str, str]:
    """Sources other installed packages provide: name -> "module:Class";
    a built-in name is never replaced.

    Read once per process: a package installed later is found after a restart.
    """
    found: dict[str, str] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in REGISTRY:
            log.warning(
                "plug-in source %r (%s) ignored: a built-in source has that name; "
                "rename its entry point",
                point.name,
                point.value,
            )
        else:
            found.setdefault(point.name, point.value)
    return found


def available() -> dict[str, str]:
    """Every source name, built-ins first: name -> "module:Class"."""
    return {**REGISTRY, **plugins()}


def check_names(config: Config) -> None:
    """Raise ConfigError for a source `--sources` names that does not exist."""
    known = available()
    unknown = [name for name in config.sources if name != "auto" and name not in known]
    if unknown:
        raise ConfigError(
            "sources",
            ",".join(config.sources),
            f"unknown source {unknown[0]!r}; known: auto, {', '.join(sorted(known))}",
        )


def source_class(name: str) -> type[Source]:
    """Import and return the class registered under name;
    one that cannot be imported becomes a down source."""
    target = available()[name]
    module_name, _, attribute = target.partition(":")
    try:
        found = functools.reduce(
            getattr, attribute.split("."), importlib.import_module(module_name)
        )
    except Exception as err:  # a broken plug-in install must not stop the agent
        return _unloadable(name, target, f"{type(err).__name__}: {err}")
    if not (isinstance(found, type) and issubclass(found, Source)):
        return _unloadable(
            name, target, "it is not a subclass of kepler_bridge.sources.base.Source"
        )
    return found


def make_source(name: str, config: Config) -> Source:
    """The source registered under name, made for `config`; one whose constructor raises (a
    plug-in that opens its device there) becomes a down source, as one that cannot be imported."""
    made = source_class(name)
    try:
        return made(config)
    except Exception as err:  # a broken plug-in must not stop the agent
        target, reason = available()[name], f"{type(err).__name__}: {err}"
        return _unloadable(name, target, reason, "cannot be made")(config)


def _unloadable(
    name: str, target: str, reason: str, failed: str = "cannot be loaded"
) -> type[Source]:
    message = (
        f"source {name} ({target}) {failed}: {reason}; "
        f"reinstall or fix the package that provides it, or remove {name} from --sources"
    )

    class Unloadable(Source):
        """Stands in for a source whose code cannot be imported: always down, with the reason."""

        auto = True  # an installed but broken plug-in shows up as down instead of vanishing

        def start(self) -> None:
            raise SourceUnavailable(message)

        def read(self) -> SourceReading:
            raise SourceUnavailable(message)

    Unloadable.name = name
    return Unloadable


def selected_groups(config: Config) -> list[tuple[str, ...]]:
    """Groups of alternative source names this config asks for."""
    auto = "auto" in config.sources
    groups = list(AUTO) if auto else []
    if auto:
        groups += [(name,) for name in plugins() if source_class(name).auto]
    chosen = {name for group in groups for name in group}
    for name in config.sources:
        if name != "auto" and name not in chosen:
            groups.append((name,))
            chosen.add(name)
    if config.command and "command" not in chosen:
        groups.append(("command",))
    if config.simulate and "simulated" not in chosen:
        groups.append(("simulated",))
    return groups
