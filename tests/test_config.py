"""Settings: precedence, parsing, and one test per kind of bad value (exit 2, one line)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from agent import KEPLER_BRIDGE
from kepler_bridge.config import ConfigError, load
from kepler_bridge.exposition import RenderSettings
from kepler_bridge.settings_parse import duration as parse_duration
from kubefakes import self_signed


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KEPLER_BRIDGE, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


def refused(*args: str) -> str:
    """The one stderr line of `kepler-bridge collect ARGS`, asserting exit 2 and no stdout."""
    result = run_cli("collect", *args)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert result.stdout == "" and line.startswith("kepler-bridge: bad setting ")
    return line


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("500ms", 0.5),
        ("5s", 5.0),
        ("1m", 60.0),
        ("1m30s", 90.0),
        ("1.5s", 1.5),
        ("2", 2.0),
        ("0.25", 0.25),
        ("1h", 3600.0),
        ("250us", 0.00025),
        ("250µs", 0.00025),
        ("250μs", 0.00025),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_durations_sum_in_nanoseconds_and_take_ascii_digits_only() -> None:
    assert parse_duration("100000us") == 0.1  # exactly: the 100 ms lower bound of --interval
    for text in ("٥s", "٥", "1٥ms"):
        with pytest.raises(ValueError):
            parse_duration(text)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("interval: 3s\nlisten: 127.0.0.1:1111\nnode_name: from-file\nsimulate: 4\n")
    env = {"KEPLER_BRIDGE_INTERVAL": "2s", "KEPLER_BRIDGE_LISTEN": "127.0.0.1:2222"}
    config = load({"config": str(file), "interval": "1s"}, env)
    assert config.interval == 1.0
    assert config.listen == ("127.0.0.1", 2222)
    assert config.node_name == "from-file"
    assert config.simulate == 4
    assert config.baetyl_memory_unit == "bytes"


def test_kepler_sampling_interval_is_also_read() -> None:
    assert load({}, {"KEPLER_SAMPLING_INTERVAL": "5s"}).interval == 5.0
    assert (
        load({}, {"KEPLER_SAMPLING_INTERVAL": "5s", "KEPLER_BRIDGE_INTERVAL": "2s"}).interval == 2.0
    )


def test_node_name_from_kube_node_name_else_hostname() -> None:
    import socket

    assert load({}, {"KUBE_NODE_NAME": "edge-7"}).node_name == "edge-7"
    assert load({}, {}).node_name == socket.gethostname()


def test_seed_style_metrics_file_is_the_allow_list(tmp_path: Path) -> None:
    file = tmp_path / "metrics.json"
    file.write_text('{"metrics": ["gpu_utilization", "gpu_memory_used", "gpu_temperature"]}')
    allowed = RenderSettings.of(load({"config": str(file)}, {})).metric_allowed
    assert allowed("gpu_utilization_ratio")
    assert allowed("gpu_memory_used_bytes")
    assert not allowed("gpu_power_watts")


def test_allow_and_deny_prefixes() -> None:
    allowed = RenderSettings.of(
        load({"metrics_allow": "gpu_", "metrics_deny": "gpu_process"}, {})
    ).metric_allowed
    assert allowed("gpu_up")
    assert not allowed("gpu_process_memory_used_bytes")
    assert not allowed("kepler_bridge_build_info")


def test_listen_forms() -> None:
    assert load({"listen": "[::1]:9400"}, {}).listen == ("::1", 9400)
    assert load({"listen": ":9400"}, {}).listen == ("", 9400)  # every address
    assert load({"listen": "0.0.0.0:9400"}, {}).listen == ("0.0.0.0", 9400)  # IPv4's only
    assert load({}, {}).listen == ("", 30060)
    assert load({"listen": "localhost:9400"}, {}).listen == ("localhost", 9400)


BAD_CASES = {
    "bad duration": (["--interval", "fast"], {}, "interval='fast'", "duration"),
    "duration too short": (["--interval", "1ms"], {}, "interval='1ms'", "100ms"),
    "bad duration in env": (
        [],
        {"KEPLER_BRIDGE_INTERVAL": "1x"},
        "KEPLER_BRIDGE_INTERVAL",
        "duration",
    ),
    "bad listen address": (["--listen", "localhost"], {}, "listen='localhost'", "HOST:PORT"),
    "bad listen port": (
        ["--listen", "127.0.0.1:70000"],
        {},
        "listen='127.0.0.1:70000'",
        "HOST:PORT",
    ),
    "wrong type": (["--simulate", "two"], {}, "simulate='two'", "whole number"),
    "negative count": (["--simulate", "-1"], {}, "simulate='-1'", "whole number"),
    "bad memory unit": (
        ["--baetyl-memory-unit", "GB"],
        {},
        "baetyl_memory_unit='GB'",
        "bytes, KiB, MiB",
    ),
    "unknown source": (["--sources", "nvml,quantum"], {}, "quantum", "known"),
    "unknown flag": (["--colour", "red"], {}, "--colour", "--help"),
    "abbreviated flag": (["--node-na", "edge-7"], {}, "--node-na", "--help"),
    "abbreviated flag with its value": (["--interv=2s"], {}, "--interv=2s", "--help"),
    "unreadable file": (
        ["--config", "/nonexistent/kb.yaml"],
        {},
        "config='/nonexistent/kb.yaml'",
        "cannot read",
    ),
    "tls half": (["--tls-cert", "/etc/hostname"], {}, "tls_key", "together"),
    "grace not a number": (["--process-grace", "nan"], {}, "process_grace='nan'", "0 to 24h"),
    "grace infinite in env": (
        [],
        {"KEPLER_BRIDGE_PROCESS_GRACE": "inf"},
        "KEPLER_BRIDGE_PROCESS_GRACE",
        "0 to 24h",
    ),
    "grace overflows": (["--process-grace", "1e400"], {}, "process_grace='1e400'", "0 to 24h"),
    "grace negative": (["--process-grace", "-1"], {}, "process_grace='-1'", "0 to 24h"),
    "grace over a day": (["--process-grace", "25h"], {}, "process_grace='25h'", "0 to 24h"),
    "interval not a number": (["--interval", "nan"], {}, "interval='nan'", "100ms to 1h"),
    "command timeout infinite": (
        ["--command-timeout", "inf"],
        {},
        "command_timeout='inf'",
        "100ms to 10m",
    ),
    "header timeout not a number": (
        ["--http-header-timeout", "nan"],
        {},
        "http_header_timeout='nan'",
        "500ms",
    ),
    "write timeout overflows": (
        ["--http-write-timeout", "1e400"],
        {},
        "http_write_timeout='1e400'",
        "500ms",
    ),
    "duration digits overflow": (
        ["--interval", "9" * 400 + "s"],
        {},
        "interval='999",
        "100ms to 1h",
    ),
    "tdp not a number": (["--cpu-tdp-watts", "nan"], {}, "cpu_tdp_watts='nan'", "0 to 100000"),
    "tdp overflows": (["--cpu-tdp-watts", "1e400"], {}, "cpu_tdp_watts='1e400'", "0 to 100000"),
    "idle watts infinite": (["--gpu-idle-watts=-inf"], {}, "gpu_idle_watts='-inf'", "0 to 100000"),
    "float for a count": (["--simulate", "1.0"], {}, "simulate='1.0'", "whole number"),
    "huge count": (["--simulate", "9" * 5000], {}, "simulate='999", "0 to 1024"),
    "too many simulated": (["--simulate", "100000"], {}, "simulate='100000'", "0 to 1024"),
    "max processes past pid_max": (
        ["--max-processes", "99999999"],
        {},
        "max_processes='99999999'",
        "4194304",
    ),
    "top past pid_max": (
        ["--process-metrics", "top:99999999"],
        {},
        "process_metrics='top:99999999'",
        "4194304",
    ),
    "line break in a name": (["--node-name", "edge\n7"], {}, "node_name='edge\\n7'", "node name"),
    "line break in a flag": (["--col\nour", "red"], {}, "--col\\nour", "--help"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_setting_exits_2_with_one_line(case: str) -> None:
    args, env, names, accepted = BAD_CASES[case]
    result = run_cli("collect", *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert names in lines[0] and accepted in lines[0]
    assert result.stdout == ""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "content,names,accepted",
    [
        ("interval: 1s\ncolour: red\n", "colour", "unknown key"),
        ("simulate: [1, 2]\n", "simulate=[1, 2]", "whole number"),
        ("interval: 1s\n  listen: [\n", "config=", "YAML syntax error at line"),
        ("- just\n- a list\n", "config=", "mapping"),
        ("interval: soon\n", "interval='soon'", "duration"),
    ],
)
def test_bad_config_file_exits_2_with_one_line(
    tmp_path: Path, content: str, names: str, accepted: str
) -> None:
    file = tmp_path / "kb.yaml"
    file.write_text(content)
    result = run_cli("collect", "--config", str(file))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert names in line and accepted in line, line
    assert str(file) in line


@pytest.mark.e2e
@pytest.mark.parametrize(
    "name,content,names,accepted",
    [
        ("kb.yaml", b"interval: 1:30\n", "interval='1:30'", "duration"),
        ("kb.yaml", b"simulate: true\n", "simulate='true'", "whole number"),
        ("kb.json", b'{"simulate": true}', "simulate=True", "whole number"),
        ("kb.json", b'{"simulate": 2.0}', "simulate=2.0", "whole number"),
        ("kb.yaml", b"simulate: 0x10\n", "simulate='0x10'", "whole number"),
        ("kb.yaml", b"simulate: !!int 0o17\n", "config=", "decimal digits"),
        ("kb.json", b'{"max_processes": 1' + b"0" * 5000 + b"}", "config=", "cannot read a number"),
        ("kb.json", b'{"process_grace": 1e400}', "process_grace=inf", "0 to 24h"),
        ("kb.yaml", b"process_grace: .nan\n", "process_grace='.nan'", "0 to 24h"),
        ("kb.json", b'{"cpu_tdp_watts": -Infinity}', "cpu_tdp_watts=-inf", "0 to 100000"),
        (
            "kb.json",
            b'{"procfs": "/host/pr\\u0000oc"}',
            "procfs='/host/pr\\x00oc'",
            "directory path",
        ),
        ("kb.yaml", b"~: 1\n", "None (in", "unknown key"),
        ("kb.yaml", b'"col\\nour": red\n', "col\\nour (in", "unknown key"),
        ("kb.json", b'{"' + b"k" * 900_000 + b'": 1}', "k" * 120 + "... (in", "unknown key"),
        ("kb.yaml", b"node_name: [edge-7]\n", "node_name=['edge-7']", "node name"),
        ("kb.yaml", b"listen: {host: 0.0.0.0}\n", "listen={'host': '0.0.0.0'}", "HOST:PORT"),
        ("kb.yaml", b"metrics: [~]\n", "metrics_allow=[None]", "prefixes"),
        ("kb.yaml", b"[" * 10000 + b"]" * 10000, "config=", "nested too deeply"),
        ("kb.json", b"[" * 100000 + b"]" * 100000, "config=", "nested too deeply"),
        ("kb.yaml", b"\xff\xfeinterval: 1s\n", "config=", "not UTF-8"),
        ("kb.yaml", b"interval: 1s\x00\n", "config=", "YAML syntax error"),
        ("kb.yaml", b"metrics_deny: [x]\nmetrics_deny: []\n", "config=", "given twice"),
        ("kb.json", b'{"interval": "1s", "interval": "5s"}', "config=", "'interval' given twice"),
        ("kb.yaml", b"interval: 1s\n" * 100000, "config=", "larger than 1 MiB"),
    ],
)
def test_hostile_config_file_exits_2_with_one_line(
    tmp_path: Path, name: str, content: bytes, names: str, accepted: str
) -> None:
    file = tmp_path / name
    file.write_bytes(content)
    line = refused("--config", str(file))
    assert names in line and accepted in line, line
    assert len(line) < 2000, "the line is cut"


@pytest.mark.e2e
def test_a_fifo_at_the_config_path_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "kb.yaml"
    os.mkfifo(fifo)
    line = refused("--config", str(fifo))
    assert "not a regular file" in line, line


@pytest.mark.e2e
@pytest.mark.parametrize("key", ["auth_token_file", "tls_cert", "tls_key"])
def test_null_protection_setting_in_file_is_refused(tmp_path: Path, key: str) -> None:
    file = tmp_path / "kb.yaml"
    file.write_text(f"{key}:\n")
    line = refused("--config", str(file))
    assert f"{key}=None (from {file})" in line and "delete the key" in line, line


@pytest.mark.parametrize(
    "name,content",
    [
        ("kb.yaml", "node_name:\nmetrics:\nprocfs: ~\ninterval: null\ncommand:\n"),
        (
            "kb.json",
            '{"node_name": null, "metrics": null, "procfs": null, "interval": null, '
            '"command": null}',
        ),
    ],
)
def test_null_in_file_means_not_set(tmp_path: Path, name: str, content: str) -> None:
    file = tmp_path / name
    file.write_text(content)
    config = load({"config": str(file)}, {})
    assert (
        config.node_name,
        config.metrics_allow,
        config.procfs,
        config.interval,
        config.command,
    ) == (socket.gethostname(), (), "/proc", 1.0, ())
    assert load({"config": str(file)}, {"KUBE_NODE_NAME": "edge-7"}).node_name == "edge-7"


def test_yaml_scalars_are_read_as_written(tmp_path: Path) -> None:
    file = tmp_path / "kb.yaml"
    file.write_text(
        "node_name: 0123\nsimulate: 2\ninterval: 90\nkube_insecure_skip_tls_verify: on\n"
        "command: [echo, 2001-12-14, yes, 0o17, 1:30]\n"
    )
    config = load({"config": str(file)}, {})
    assert (
        config.node_name,
        config.simulate,
        config.interval,
        config.kube_insecure_skip_tls_verify,
    ) == ("0123", 2, 90.0, True)
    assert config.command == ("echo", "2001-12-14", "yes", "0o17", "1:30")
    file.write_text("node_name: 123\n")
    assert load({"config": str(file)}, {}).node_name == "123"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "content,accepted",
    [
        (b"", "the file is empty"),
        (b" \n\t\r\n", "the file is empty"),
        (b"two words\n", "blanks"),
        (b"first\nsecond\n", "line breaks"),
        (b"caf\xc3\xa9\n", "non-ASCII"),
        (b"x" * 70000, "larger than 64 KiB"),
        (None, "Is a directory"),
    ],
)
def test_bad_token_file_exits_2_with_one_line(
    tmp_path: Path, content: bytes | None, accepted: str
) -> None:
    token = tmp_path / "token"
    if content is None:
        token.mkdir()
    else:
        token.write_bytes(content)
    line = refused("--auth-token-file", str(token))
    assert f"auth_token_file='{token}' (from --auth-token-file)" in line and accepted in line, line


def test_token_is_read_once_at_load_and_kept_out_of_repr(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  s3cret-Token_42\n")
    config = load({"auth_token_file": str(token)}, {})
    token.write_text("changed\n")
    assert config.auth_token == b"s3cret-Token_42"
    assert "s3cret" not in repr(config)
    assert load({}, {}).auth_token == b""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two certificate/key pairs from the openssl CLI, an encrypted key, and a garbage file."""
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    (cert, key), (_, other_key) = self_signed(first), self_signed(second)
    encrypted, garbage = first / "encrypted.key", first / "garbage.pem"
    subprocess.run(
        [
            "openssl",
            "pkey",
            "-in",
            str(key),
            "-aes256",
            "-passout",
            "pass:x",
            "-out",
            str(encrypted),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    garbage.write_text(
        "-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n"
    )
    return {
        "cert": cert,
        "key": key,
        "other key": other_key,
        "encrypted": encrypted,
        "garbage": garbage,
        "directory": first,
    }


@pytest.mark.e2e
@pytest.mark.parametrize(
    "cert,key,setting,accepted",
    [
        ("cert", "garbage", "tls_key", "not a PEM private key"),
        ("cert", "other key", "tls_key", "does not belong to the certificate"),
        ("cert", "encrypted", "tls_key", "encrypted with a passphrase"),
        ("cert", "directory", "tls_key", "Is a directory"),
        ("cert", "cert", "tls_key", "not a PEM private key"),
        ("garbage", "key", "tls_cert", "not a PEM certificate"),
        ("key", "key", "tls_cert", "not a PEM certificate"),
        ("directory", "key", "tls_cert", "Is a directory"),
    ],
)
def test_bad_certificate_pair_exits_2_with_one_line(
    pairs: dict[str, Path], cert: str, key: str, setting: str, accepted: str
) -> None:
    line = refused("--tls-cert", str(pairs[cert]), "--tls-key", str(pairs[key]))
    flag = "--" + setting.replace("_", "-")
    path = pairs[key] if setting == "tls_key" else pairs[cert]
    assert f"{setting}='{path}' (from {flag})" in line and accepted in line, line


def test_good_certificate_pair_is_accepted(pairs: dict[str, Path]) -> None:
    config = load({"tls_cert": str(pairs["cert"]), "tls_key": str(pairs["key"])}, {})
    assert (config.tls_cert, config.tls_key) == (str(pairs["cert"]), str(pairs["key"]))


def test_config_file_from_env(tmp_path: Path) -> None:
    file = tmp_path / "kb.json"
    file.write_text('{"interval": "7s"}')
    assert load({}, {"KEPLER_BRIDGE_CONFIG": str(file)}).interval == 7.0
    with pytest.raises(ConfigError, match="JSON syntax error"):
        file.write_text('{"interval": ')
        load({}, {"KEPLER_BRIDGE_CONFIG": str(file)})
