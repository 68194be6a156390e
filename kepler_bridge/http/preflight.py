"""Checks the files the HTTP server will read (the TLS pair, the web config) before gunicorn
forks."""

from __future__ import annotations

from kepler_bridge.config import Config, ConfigError
from kepler_bridge.http.tls import TLSError, server_context
from kepler_bridge.http.webconfig import WebConfigError
from kepler_bridge.http.webconfig import read as read_web_config


def check(config: Config) -> None:
    """Raise ConfigError (the CLI's exit 2 and one line) for a TLS pair or web config the server
    cannot use."""
    if config.tls_cert:
        try:
            server_context(config.tls_cert, config.tls_key)
        except TLSError as err:
            key = f"tls_{err.part}"
            origin = config.origins.get(key, "")
            raise ConfigError(key, getattr(config, key), str(err), origin) from None
    if config.web_config_file:
        _check_web_config(config)


def _check_web_config(config: Config) -> None:
    path, origin = config.web_config_file, config.origins.get("web_config_file", "")
    try:
        web = read_web_config(path)
    except WebConfigError as err:
        raise ConfigError("web_config_file", path, str(err), origin) from None
    if web.tls is not None and config.tls_cert:
        raise ConfigError(
            "web_config_file",
            path,
            "it sets tls_server_config and --tls-cert/--tls-key are given too; keep one of the two",
            origin,
        )
