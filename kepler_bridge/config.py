"""Settings: one table, read from flags > environment > config file > default."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from kepler_bridge import settings_file
from kepler_bridge import settings_parse as parse
from kepler_bridge.settings_anomaly import AnomalyTable
from kepler_bridge.settings_parse import ConfigError, Setting


@dataclass(frozen=True)
class Config(AnomalyTable):
    """Validated settings of one agent run: the settings table's values and what load() adds."""

    # Read from auth_token_file once, by load().
    auth_token: bytes = field(repr=False)
    config_file: str
    # Where each setting's value came from (a flag, a variable, the file or "default"),
    # for error lines.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def listen_text(self) -> str:
        host, port = self.listen
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


SETTINGS: tuple[Setting, ...] = parse.settings_of(Config)
_BY_KEY = {setting.key: setting for setting in SETTINGS}


def load(flags: Mapping[str, object], environ: Mapping[str, str] | None = None) -> Config:
    """Resolve every setting by precedence flag > env > file > default, and validate it."""
    environ = os.environ if environ is None else environ
    config_file = flags.get("config") or environ.get("KEPLER_BRIDGE_CONFIG") or ""
    from_file = settings_file.read(str(config_file), _BY_KEY) if config_file else {}
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for setting in SETTINGS:
        raw, origins[setting.key] = _pick(setting, flags, environ, from_file, str(config_file))
        try:
            values[setting.key] = setting.parse(raw)
        except (ValueError, TypeError, OverflowError):
            raise ConfigError(setting.key, raw, setting.accepted, origins[setting.key]) from None
    if not values["node_name"]:
        values["node_name"] = socket.gethostname()
    if bool(values["tls_cert"]) != bool(values["tls_key"]):
        raise ConfigError(
            "tls_key" if values["tls_cert"] else "tls_cert",
            "",
            "--tls-cert and --tls-key must be given together",
        )
    token_file = str(values["auth_token_file"])
    token = settings_file.read_token(token_file, origins["auth_token_file"]) if token_file else b""
    return Config(config_file=str(config_file), auth_token=token, origins=origins, **values)


def _pick(
    setting: Setting,
    flags: Mapping[str, object],
    environ: Mapping[str, str],
    from_file: Mapping[str, object],
    config_file: str,
) -> tuple[object, str]:
    if flags.get(setting.key) is not None:
        return flags[setting.key], setting.flag
    for env in setting.envs:
        if environ.get(env, "") != "":
            return environ[env], env
    if setting.key in from_file:
        return from_file[setting.key], config_file
    return setting.default, "default"
