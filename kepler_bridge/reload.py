"""Re-reading the settings while the agent runs (SIGHUP, or a change of the config file)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Generic, Mapping, TypeVar

from kepler_bridge.config import Config, ConfigError, load

log = logging.getLogger(__name__)

# What a running agent can change without losing counters or reopening drivers,
# the port or the eBPF programs.
RELOADABLE = frozenset(
    {
        "interval",
        "metrics_allow",
        "metrics_deny",
        "metric_names",
        "process_metrics",
        "process_grace",
        "device_grace",
        "baetyl_memory_unit",
        "command",
        "command_timeout",
        "cpu_tdp_watts",
        "gpu_idle_watts",
        "nvml_reprobe_interval",
        "nvml_counter_interval",
        "kube_source",
        "kubelet_url",
        "metaserver_url",
        "kube_token_file",
        "kube_ca_file",
        "kube_insecure_skip_tls_verify",
        "kube_max_reply_bytes",
        "kube_timeout",
        "device_environment",
        "anomaly",
        "anomaly_window",
        "anomaly_refit",
        "anomaly_sensitivity",
    }
)
KUBE = frozenset(name for name in RELOADABLE if name.startswith("kube") or name == "metaserver_url")
T = TypeVar("T")


class ConfigFileWatch:
    """Tells when a config file, or a file it names, changed since it was last asked (a ConfigMap
    swap included); an empty path is never watched, a missing file counts as one state."""

    def __init__(self, *paths: str) -> None:
        self.paths = tuple(path for path in paths if path)
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self.paths:
            try:
                info = os.stat(path)  # follows the ..data link a ConfigMap volume swaps on update
            except OSError:
                stamps.append(None)
            else:
                stamps.append((info.st_ino, info.st_mtime_ns, info.st_size))
        return tuple(stamps)

    def changed(self) -> bool:
        """Whether the files differ from the last call (or from construction); each change is told
        once."""
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class DerivedSettings(Generic[T]):
    """What `derive` makes of the settings in force (such as `WebSettings`), made again only when a
    reload has replaced them."""

    def __init__(self, current: Callable[[], Config], derive: Callable[[Config], T]) -> None:
        self._current, self._derive = current, derive
        self._last: tuple[Config, T] | None = None

    def __call__(self) -> T:
        config, last = self._current(), self._last
        if last is None or last[0] is not config:
            # One swap: readers on other threads need no lock.
            last = self._last = (config, self._derive(config))
        return last[1]


def reread(
    current: Config,
    flags: Mapping[str, object],
    environ: Mapping[str, str] | None = None,
    quiet: bool = False,
    check: Callable[[Config], None] | None = None,
) -> Config | None:
    """The settings as flags, environment and file now give them, keeping those that need a restart;
    None when the new settings are refused (one log line; the running settings stay): by `load`,
    or by `check`, the checks start-up makes beyond each value (ConfigError). `quiet`: no line
    when nothing changed."""
    try:
        new = load(flags, environ)
        if check is not None:
            check(new)
    except ConfigError as err:
        log.error("settings not reloaded, the running ones stay: %s", err)
        return None
    kept = [
        field.name
        for field in dataclasses.fields(Config)
        if field.compare
        and field.name not in RELOADABLE
        and getattr(new, field.name) != getattr(current, field.name)
    ]
    if kept:
        log.warning(
            "settings reloaded, except %s: restart the agent to apply a change of %s",
            ", ".join(kept),
            "it" if len(kept) == 1 else "them",
        )
    changed = sorted(name for name in RELOADABLE if getattr(new, name) != getattr(current, name))
    if changed or kept or not quiet:
        log.info("settings reloaded: %s", ", ".join(changed) or "nothing changed")
    return dataclasses.replace(new, **{name: getattr(current, name) for name in kept})


class SettingsWatch:
    """Tells when a running sampler reads its settings again, after `ask()` (SIGHUP) or a change
    of the config file, and reads them."""

    def __init__(
        self,
        flags: Mapping[str, object] | None,
        config_file: str,
        check: Callable[[Config], None] | None = None,
    ) -> None:
        """`flags`: the command line the settings came from; without it nothing is re-read.
        `check`: as `reread`'s. They are read again at the first check, quietly: a change made
        (or a SIGHUP sent, which the agent ignores while it starts) since they were read is not
        lost."""
        self._flags, self._check, self._path = flags, check, config_file
        self._file = ConfigFileWatch(config_file)
        self._asked = True
        self._first = True

    def ask(self) -> None:
        """Read the settings again at the next check. Called from a signal handler: a lock here
        (threading.Event) deadlocks when a second signal comes while the first holds it."""
        self._asked = True

    def new_settings(self, current: Config) -> Config | None:
        """The settings as they are now when asked or the file changed (see `reread`), else None."""
        if self._flags is None or not (self._file.changed() or self._asked):
            return None
        self._asked = False  # before reading: an ask from now on reads again
        first, self._first = self._first, False
        if not first and self._emptied():
            return None
        return reread(current, self._flags, quiet=first, check=self._check)

    def _emptied(self) -> bool:
        """Whether the config file is empty now (logged): a file being rewritten in place (`>`)
        is, and taken it would set every setting back to its default. The write's end, a change
        of the file, is read."""
        try:
            empty = bool(self._path) and os.stat(self._path).st_size == 0
        except OSError:
            return False  # reread says why
        if empty:
            log.error(
                "settings not reloaded, the running ones stay: %s is empty (being written?); "
                "to go back to the defaults, leave a comment in it",
                self._path,
            )
        return empty
