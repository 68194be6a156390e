"""The files read at load: the config file and the bearer-token file.

The config file (`--config FILE`) is YAML or JSON, read as written into setting keys and values.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Collection

from kepler_bridge.settings_parse import ConfigError

# The seed's allow-list file: {"metrics": ["gpu_utilization", ...]}.
_FILE_ALIASES = {"metrics": "metrics_allow"}
# In the file a null value means "not set", except here: there it would silently serve without
# protection.
_NULL_REFUSED = ("auth_token_file", "tls_cert", "tls_key")
MAX_CONFIG_BYTES = 1 << 20
MAX_TOKEN_BYTES = 64 << 10
MAX_KEY_SHOWN = 120  # an unknown key is cut in the error line, as a value is


def _raw(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_CONFIG_BYTES."""
    try:
        # Not blocking: a FIFO put at the path would hold the reader (the sampler) for good.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ConfigError("config", path, "not a regular file; give a YAML or JSON file")
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as err:
        raise ConfigError("config", path, f"cannot read the file: {err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("config", path, "larger than 1 MiB; a config file holds a few settings")
    return raw


def read(path: str, keys: Collection[str]) -> dict[str, object]:
    """Read a YAML or JSON config file into a mapping of setting keys; a null value is not set."""
    raw = _raw(path)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            "config", path, f"not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None
    data = _parse(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, "expected a mapping of setting names to values")
    known = sorted(set(keys) | set(_FILE_ALIASES))
    result: dict[str, object] = {}
    for key, value in data.items():
        name = _FILE_ALIASES[key] if key in _FILE_ALIASES else key
        if name not in keys:
            shown = str(key) if len(str(key)) <= MAX_KEY_SHOWN else f"{str(key)[:MAX_KEY_SHOWN]}..."
            raise ConfigError(
                f"{shown} (in {path})",
                value,
                f"unknown key; accepted keys: {', '.join(known)}",
            )
        if value is None and name in _NULL_REFUSED:
            raise ConfigError(
                name,
                value,
                "an empty value would turn it off; give the file's "
                "path, or delete the key to serve without it",
                path,
            )
        if value is not None:
            result[name] = value
    return result


NESTED = "nested too deeply; a setting is a value or a flat list"


def _parse(path: str, text: str) -> object:
    """The document in a config file: JSON where the name ends in .json, else YAML."""
    try:
        if path.endswith(".json"):
            return json.loads(text, object_pairs_hook=_unique_keys)
        return _yaml(path, text)
    except _KeyTwice as err:
        raise ConfigError("config", path, f"JSON {err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            "config", path, f"JSON syntax error at line {err.lineno}: {err.msg}"
        ) from None
    except RecursionError:
        raise ConfigError("config", path, NESTED) from None
    except ValueError as err:  # JSON integers longer than Python converts (4300 digits)
        raise ConfigError(
            "config", path, f"cannot read a number: {str(err).split(':')[0]}"
        ) from None


class _KeyTwice(ValueError):
    """A JSON object in the config file gives a key twice."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object's pairs as a dict; a key given twice is refused, as YAML's are."""
    found: dict[str, object] = {}
    for key, value in pairs:
        if key in found:
            raise _KeyTwice(f"key {key!r} given twice (keep one: the later would win)")
        found[key] = value
    return found


def _yaml(path: str, text: str) -> object:
    """A YAML document; PyYAML is imported here, where a YAML config file is read."""
    from kepler_bridge import settings_yaml

    try:
        return settings_yaml.load(text)
    except settings_yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if problem == "exceeded maximum nesting depth":  # libyaml's limit, 1000 levels
            raise ConfigError("config", path, NESTED) from None
        raise ConfigError("config", path, f"YAML syntax error{line}: {problem}") from None


def read_token(path: str, origin: str = "") -> bytes:
    """The bearer token in the file: one line of visible ASCII characters, blanks around removed."""
    fix = (
        "write one line of visible ASCII characters into it, such as the output of "
        "openssl rand -hex 32"
    )
    try:
        with open(path, "rb") as file:
            token = file.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as err:
        raise ConfigError(
            "auth_token_file",
            path,
            f"cannot read the file: {err.strerror or err}; "
            "give the path of the file holding the bearer token",
            origin,
        ) from None
    if not token:
        raise ConfigError(
            "auth_token_file",
            path,
            f"the file is empty, so no token would be required; {fix}, "
            "or leave the setting unset to serve /metrics without one",
            origin,
        )
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(
            "auth_token_file", path, f"larger than 64 KiB, not a bearer token; {fix}", origin
        )
    if not re.fullmatch(rb"[\x21-\x7e]+", token):
        raise ConfigError(
            "auth_token_file",
            path,
            "the token has blanks, line breaks or non-ASCII characters inside "
            f"(a bearer token is visible ASCII, RFC 6750); {fix}",
            origin,
        )
    return token
