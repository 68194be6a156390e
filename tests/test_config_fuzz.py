"""Hostile config files, flags and environment.

Every outcome is a clean config or one line naming the setting.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent import KEPLER_BRIDGE
from kepler_bridge.config import SETTINGS, ConfigError, load

KEYS = [setting.key for setting in SETTINGS] + ["metrics"]
ENVS = [env for setting in SETTINGS for env in setting.envs]
SETTING_OF_ENV = {env: setting.key for setting in SETTINGS for env in setting.envs}
# Plain YAML scalars that YAML 1.1 reads as something else than their text, and other odd values.
ODD_YAML = [
    "",
    "~",
    "null",
    "1:30",
    "0123",
    "0o17",
    "0x1F",
    "1_000",
    "yes",
    "on",
    "off",
    ".nan",
    "-.inf",
    "1e400",
    "1.0e+400",
    "-1",
    "2001-12-14",
    "!!int 5",
    "!!int 0x10",
    "!!float 1",
    "!!binary aGk=",
    "!!set {a}",
    "!!python/name:os.system",
    "&a x",
    "*a",
    "<<: {}",
    "[1, [2, [3]]]",
    "{a: 1}",
    "'quoted'",
    '"\\0"',
    '"\\u2028"',
    '"a\\nb"',
    "9" * 30,
    "9" * 5000,
    "top:50",
    "0.0.0.0:30060",
    "5s",
    "|\n  block",
    ">-",
]
ODD_JSON = [
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "-0",
    "1" * 5000,
    "true",
    "null",
    "[[[]]]",
    '{"a": {}}',
    '"\\u0000"',
    '"\\ud800"',
    "1.5",
    "65",
    '"5s"',
    '"top:3"',
]
ODD_TEXT = [
    "nan",
    "inf",
    "-inf",
    "1e400",
    "-1",
    "1.5",
    "0x10",
    "٣",
    "1:30",
    "",
    " ",
    "a\x00b",
    "top:0",
    "off",
    "1" * 5000,
    "127.0.0.1:0",
    "[::1]:30060",
    "'unclosed",
    "true",
    "/dev/zero",
    "/",
    ".",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([2**63, -(2**63), 10**400]),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(ODD_TEXT),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
# Mostly known keys, so that most files reach the settings' parsers; some files add one unknown key.
documents = st.tuples(
    st.dictionaries(st.sampled_from(KEYS), values, max_size=5),
    st.just({}) | st.dictionaries(st.text(max_size=12), values, max_size=1),
).map(lambda parts: {**parts[0], **parts[1]})
# Keys written into a line of text by hand: known ones or a plain word,
# so that the file has exactly these keys.
line_keys = (
    st.sampled_from(KEYS) | st.sampled_from(KEYS) | st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
)


@st.composite
def config_files(draw: st.DrawFn) -> tuple[str, bytes, set[str]]:
    """A file name, its bytes, and the setting keys it may name."""
    kind = draw(
        st.sampled_from(
            [
                "json",
                "json",
                "yaml",
                "yaml",
                "yaml lines",
                "yaml lines",
                "json lines",
                "nested",
                "binary",
            ]
        )
    )
    if kind in ("json", "yaml"):
        document = draw(documents)
        text = (
            json.dumps(document) if kind == "json" else yaml.safe_dump(document, allow_unicode=True)
        )
        return f"kb.{kind}", text.encode(), set(document)
    if kind in ("yaml lines", "json lines"):
        words = (
            st.text(max_size=20) if kind == "yaml lines" else st.text(max_size=20).map(json.dumps)
        )
        odd = ODD_YAML if kind == "yaml lines" else ODD_JSON
        pairs = draw(st.lists(st.tuples(line_keys, st.sampled_from(odd) | words), max_size=5))
        if kind == "yaml lines":
            text = "\n".join(f"{key}: {raw}" for key, raw in pairs)
        else:
            text = "{" + ", ".join(f'"{key}": {raw}' for key, raw in pairs) + "}"
        return f"kb.{kind.split()[0]}", text.encode(), {key for key, _ in pairs}
    if kind == "nested":
        depth, key = draw(st.integers(1, 3000)), draw(st.sampled_from(KEYS))
        form = draw(st.sampled_from(["yaml", "json"]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a": ', "}")]))
        nest = f"{opener * depth}1{closer * depth}"
        text = f"{key}: {nest}" if form == "yaml" else f'{{"{key}": {nest}}}'
        return f"kb.{form}", text.encode(), {key}
    return draw(st.sampled_from(["kb.yaml", "kb.json"])), draw(st.binary(max_size=200)), set()


# Mostly none, so that the file's values are reached;
# flag values may hold anything, env values no NUL.
flag_values = st.just({}) | st.dictionaries(
    st.sampled_from([s.key for s in SETTINGS]), st.sampled_from(ODD_TEXT) | st.text(), max_size=2
)
env_values = st.just({}) | st.dictionaries(
    st.sampled_from(ENVS),
    (st.sampled_from(ODD_TEXT) | st.text()).map(lambda text: text.replace("\x00", "")),
    max_size=2,
)


def check_refusal(message: str, named: set[str], file_keys: set[str]) -> None:
    """One printable line naming a setting given, the config file, or an unknown key of it
    (`file_keys`: the keys the test wrote into the file, none for a random binary file)."""
    assert len(message.splitlines()) == 1 and message.isprintable(), message
    if "unknown key; accepted keys" in message:
        key = re.match(r"bad setting (.*) \(in ", message)
        assert key and key.group(1) not in KEYS, message
        # Only the file has keys: those the test knows it wrote include an unknown one;
        # a random binary file's keys it cannot know.
        assert file_keys - set(KEYS) or not file_keys, message
        return
    match = re.match(r"bad setting (\w+)=", message)
    assert match, message
    named = named | {"config"} | ({"metrics_allow"} if "metrics" in named else set())
    if named & {"tls_cert", "tls_key"}:
        named |= {"tls_cert", "tls_key"}  # one given without the other names the missing one
    assert match.group(1) in named, message


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(
    max_examples=600,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(file=config_files(), flags=flag_values, env=env_values)
# An empty key in a file the test cannot read, without and with a flag given.
@example(file=("kb.yaml", b'{"": ""}', set()), flags={}, env={})
@example(file=("kb.yaml", b'{"": ""}', set()), flags={"listen": ""}, env={})
def test_load_returns_a_config_or_one_line_naming_the_setting(
    scratch: Path, file: tuple[str, bytes, set[str]], flags: dict[str, str], env: dict[str, str]
) -> None:
    name, content, file_keys = file
    path = scratch / name
    path.write_bytes(content)
    try:
        load({"config": str(path), **flags}, env)
    except ConfigError as err:
        named = set(flags) | {SETTING_OF_ENV[env_name] for env_name in env} | file_keys
        check_refusal(str(err), named, file_keys)


@pytest.mark.e2e
@settings(
    max_examples=20,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(file=config_files())
def test_cli_exits_0_or_2_with_one_line_never_a_traceback(
    scratch: Path, file: tuple[str, bytes, set[str]]
) -> None:
    name, content, _ = file
    path = scratch / name
    path.write_bytes(content)
    # The environment names the simulated source,
    # so that a clean config takes one quick sample of no hardware.
    result = subprocess.run(
        [KEPLER_BRIDGE, "collect", "--json", "--config", str(path)],
        capture_output=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KEPLER_BRIDGE_SOURCES": "simulated"},
    )
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode in (0, 2), stderr
    assert "Traceback" not in stderr
    if result.returncode == 2:
        (line,) = stderr.strip().splitlines()
        assert line.startswith("kepler-bridge: bad setting ") and result.stdout == b"", stderr
    else:
        assert isinstance(json.loads(result.stdout), dict)
