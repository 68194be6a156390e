"""`--web.config.file` in the Prometheus exporter-toolkit format: TLS, client certificates and
basic-auth users.

The file, and every file it names, is checked on each new connection and each authenticated request;
a change is picked up then, so certificates and users rotate without a restart. A changed file that
does not load is refused with one log line, and the last good configuration stays in force.
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kepler_bridge.http.kept_files import KeptFiles
from kepler_bridge.http.tls import TLSError, server_context
from kepler_bridge.reload import ConfigFileWatch

log = logging.getLogger(__name__)

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# Python's TLS verifies every client certificate it asks for: "ask but do not verify" has no
# equivalent.
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# The version keys and the SSLContext attribute each sets.
TLS_BOUNDS = (("min_version", "minimum_version"), ("max_version", "maximum_version"))
TLS_KEYS = (
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
)
RETRY_SECONDS = 1.0  # how often a web config that does not load is read again
TOP_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config")
# bcrypt's cost runs from 4 to 31; a hash outside it passes no check.
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


class WebConfigError(Exception):
    """The web config file cannot be used; the message names the key and what to change."""


@dataclass(frozen=True)
class WebConfig:
    """One loaded web config: the TLS context (None: plain HTTP) and the basic-auth users."""

    tls: ssl.SSLContext | None = None
    allowed_sans: tuple[str, ...] = ()
    users: dict[str, bytes] = field(default_factory=dict)
    files: tuple[str, ...] = ()


def read(path: str, kept: KeptFiles | None = None) -> WebConfig:
    """Load and validate a web config file, building its TLS context; from the files as `kept`
    holds them where it is given (their names stay the real ones)."""
    # here, not at the top: an agent without a web config never loads PyYAML
    from kepler_bridge import settings_yaml

    try:
        with open(_opened(path, kept), "rb") as file:
            data: Any = settings_yaml.load_safe(file.read(1 << 20))
    except (OSError, settings_yaml.YAMLError, RecursionError) as err:
        raise WebConfigError(
            f"cannot read {path}: {_first_line(err)}; give a readable YAML file"
        ) from None
    data = {} if data is None else data
    _mapping(data, "top level", TOP_KEYS)
    _mapping(data.get("http_server_config") or {}, "http_server_config", ())
    users = _users(data.get("basic_auth_users") or {})
    tls_data = data.get("tls_server_config")
    if not tls_data:
        return WebConfig(users=users, files=(path,))
    _mapping(tls_data, "tls_server_config", TLS_KEYS)
    context, sans, files = _tls(tls_data, kept)
    return WebConfig(tls=context, allowed_sans=sans, users=users, files=(path, *files))


def _opened(path: str, kept: KeptFiles | None) -> str:
    """Where to read `path` from: `kept`'s copy of it, or itself."""
    return kept.path(path) if kept is not None and path in kept else path


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def _mapping(data: Any, where: str, keys: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise WebConfigError(f"{where}: expected a mapping")
    unknown = [str(key) for key in data if key not in keys]
    if unknown:
        accepted = ", ".join(keys) or "nothing (HTTP/2 and extra headers are not supported)"
        raise WebConfigError(
            f"{where}: unsupported key {unknown[0]!r}; remove it (accepted: {accepted})"
        )


def _tls_string(data: dict, key: str) -> str:
    """The string at tls_server_config.`key`; "" when it is absent."""
    value = data.get(key) or ""
    if not isinstance(value, str):
        raise WebConfigError(f"tls_server_config.{key}: expected a string")
    return value


def _users(data: Any) -> dict[str, bytes]:
    if not isinstance(data, dict):
        raise WebConfigError("basic_auth_users: expected a mapping of user name to bcrypt hash")
    users = {}
    for user, hashed in data.items():
        if not (
            isinstance(user, str)
            and isinstance(hashed, str)
            and _BCRYPT.fullmatch(hashed)
            and _salt_decodes(hashed.encode())
        ):
            raise WebConfigError(
                f"basic_auth_users.{user}: expected a bcrypt hash of cost 04 to 31 such as "
                "$2y$10$... (make one with: htpasswd -nBC 10 '' | tr -d ':\\n')"
            )
        users[user] = hashed.encode()
    return users


def _salt_decodes(hashed: bytes) -> bool:
    """Whether bcrypt takes the hash's salt, tried at the lowest cost: a millisecond."""
    import bcrypt

    try:
        bcrypt.checkpw(b"", hashed[:4] + b"04" + hashed[6:])
    except ValueError:
        return False
    return True


def _tls(
    data: dict, kept: KeptFiles | None = None
) -> tuple[ssl.SSLContext, tuple[str, ...], tuple[str, ...]]:
    cert, key = _tls_string(data, "cert_file"), _tls_string(data, "key_file")
    ca = _tls_string(data, "client_ca_file")
    if not cert or not key:
        raise WebConfigError("tls_server_config: cert_file and key_file are both required")
    verify_mode = _client_auth(data, ca)
    try:
        context = server_context(_opened(cert, kept), _opened(key, kept))
    except TLSError as err:
        raise WebConfigError(f"tls_server_config.{err.part}_file: {err}") from None
    for bound, attribute in TLS_BOUNDS:
        name = _tls_string(data, bound)
        if name and name not in TLS_VERSIONS:
            raise WebConfigError(
                f"tls_server_config.{bound}: {name!r} is not one of {', '.join(TLS_VERSIONS)}"
            )
        if name:
            setattr(context, attribute, TLS_VERSIONS[name])
    if 0 <= context.maximum_version < context.minimum_version:  # MAXIMUM_SUPPORTED is -1
        low = _tls_string(data, "min_version") or "TLS12 (the default minimum)"
        raise WebConfigError(
            f"tls_server_config.max_version: {_tls_string(data, 'max_version')} is below "
            f"min_version {low}, so no client could connect; raise it or lower min_version"
        )
    context.verify_mode = verify_mode
    if ca:
        try:
            context.load_verify_locations(cafile=_opened(ca, kept))
        except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
            reason = _first_line(err)
            raise WebConfigError(
                f"tls_server_config.client_ca_file: cannot load {ca}: {reason}; "
                "give a PEM file of CA certificates"
            ) from None
    return context, _allowed_sans(data, ca), tuple(path for path in (cert, key, ca) if path)


def _client_auth(data: dict, ca: str) -> ssl.VerifyMode:
    """The verify mode `client_auth_type` asks for, checked against the CA file given."""
    default = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    auth = _tls_string(data, "client_auth_type") or default
    where = "tls_server_config.client_auth_type"
    if auth in UNVERIFIED_CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: {auth} is not supported (client certificates are always "
            "verified here); use VerifyClientCertIfGiven or "
            "RequireAndVerifyClientCert"
        )
    if auth not in CLIENT_AUTH:
        raise WebConfigError(f"{where}: {auth!r} is not one of {', '.join(CLIENT_AUTH)}")
    if CLIENT_AUTH[auth] != ssl.CERT_NONE and not ca:
        raise WebConfigError(
            f"tls_server_config.client_ca_file: {auth} needs the CA that signs client certificates"
        )
    return CLIENT_AUTH[auth]


def _allowed_sans(data: dict, ca: str) -> tuple[str, ...]:
    sans = data.get("client_allowed_sans") or []
    if not isinstance(sans, list) or not all(isinstance(san, str) for san in sans):
        raise WebConfigError("tls_server_config.client_allowed_sans: expected a list of names")
    if sans and not ca:
        raise WebConfigError(
            "tls_server_config.client_allowed_sans: names of client certificates "
            "need client_ca_file, the CA that signs them"
        )
    return tuple(sans)


def peer_allowed(sock: ssl.SSLSocket, allowed_sans: tuple[str, ...]) -> bool:
    """Whether the client certificate names one of `allowed_sans` (always true when none are
    listed)."""
    if not allowed_sans:
        return True
    sans: Any = (sock.getpeercert() or {}).get("subjectAltName", ())  # ((kind, value), ...)
    names = {value for _kind, value in sans}
    return not names.isdisjoint(allowed_sans)


class WebConfigFile:
    """The web config as of its last good read; `current()` re-reads it when it or a file it
    names changed."""

    def __init__(self, path: str, kept: KeptFiles | None = None) -> None:
        """`kept`: the files as the agent started with them, in force while these do not load."""
        self.path = path
        self._lock = threading.Lock()
        try:
            self._config = read(path)
        except WebConfigError as err:
            if kept is None or path not in kept:
                raise
            log.warning(
                "web config %s does not load, the one the agent started with: %s", path, err
            )
            self._config = read(path, kept)
        self._watch = ConfigFileWatch(*self._config.files)
        self._failing, self._retry_at = "", 0.0  # why the last re-read failed; when to try again

    def current(self) -> WebConfig:
        """The web config in force; a changed file that does not load is refused, with one log
        line a reason, and read again each RETRY_SECONDS: the files it names may come later."""
        with self._lock:
            now = time.monotonic()
            if self._watch.changed() or (self._failing and now >= self._retry_at):
                self._reread(now)
            return self._config

    def _reread(self, now: float) -> None:
        try:
            config = read(self.path)
        except WebConfigError as err:
            if str(err) != self._failing:
                log.warning(
                    "web config %s not reloaded, the previous one stays in force: %s",
                    self.path,
                    err,
                )
            self._failing, self._retry_at = str(err), now + RETRY_SECONDS
            return
        self._config, self._watch, self._failing = config, ConfigFileWatch(*config.files), ""
        log.info("web config %s reloaded", self.path)
