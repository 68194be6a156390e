"""Settings: precedence, parsing, and one test per kind of bad value (exit 2, one line)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent import KEPLER_BRIDGE
from kepler_bridge.config import ConfigError, load, parse_duration


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KEPLER_BRIDGE, *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.mark.parametrize("text,seconds", [
    ("500ms", 0.5), ("5s", 5.0), ("1m", 60.0), ("1m30s", 90.0), ("1.5s", 1.5), ("2", 2.0), ("0.25", 0.25),
    ("1h", 3600.0), ("250us", 0.00025),
])
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


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
    assert load({}, {"KEPLER_SAMPLING_INTERVAL": "5s", "KEPLER_BRIDGE_INTERVAL": "2s"}).interval == 2.0


def test_node_name_from_kube_node_name_else_hostname() -> None:
    import socket

    assert load({}, {"KUBE_NODE_NAME": "edge-7"}).node_name == "edge-7"
    assert load({}, {}).node_name == socket.gethostname()


def test_seed_style_metrics_file_is_the_allow_list(tmp_path: Path) -> None:
    file = tmp_path / "metrics.json"
    file.write_text('{"metrics": ["gpu_utilization", "gpu_memory_used", "gpu_temperature"]}')
    config = load({"config": str(file)}, {})
    assert config.metric_allowed("gpu_utilization_ratio")
    assert config.metric_allowed("gpu_memory_used_bytes")
    assert not config.metric_allowed("gpu_power_watts")


def test_allow_and_deny_prefixes() -> None:
    config = load({"metrics_allow": "gpu_", "metrics_deny": "gpu_process"}, {})
    assert config.metric_allowed("gpu_up")
    assert not config.metric_allowed("gpu_process_memory_used_bytes")
    assert not config.metric_allowed("kepler_bridge_build_info")


def test_listen_forms() -> None:
    assert load({"listen": "[::1]:9400"}, {}).listen == ("::1", 9400)
    assert load({"listen": ":9400"}, {}).listen == ("0.0.0.0", 9400)
    assert load({"listen": "localhost:9400"}, {}).listen == ("localhost", 9400)


BAD_CASES = {
    "bad duration": (["--interval", "fast"], {}, "interval='fast'", "duration"),
    "duration too short": (["--interval", "1ms"], {}, "interval='1ms'", "100ms"),
    "bad duration in env": ([], {"KEPLER_BRIDGE_INTERVAL": "1x"}, "KEPLER_BRIDGE_INTERVAL", "duration"),
    "bad listen address": (["--listen", "localhost"], {}, "listen='localhost'", "HOST:PORT"),
    "bad listen port": (["--listen", "127.0.0.1:70000"], {}, "listen='127.0.0.1:70000'", "HOST:PORT"),
    "wrong type": (["--simulate", "two"], {}, "simulate='two'", "whole number"),
    "negative count": (["--simulate", "-1"], {}, "simulate='-1'", "whole number"),
    "bad memory unit": (["--baetyl-memory-unit", "GB"], {}, "baetyl_memory_unit='GB'", "bytes, KiB, MiB"),
    "unknown source": (["--sources", "nvml,quantum"], {}, "quantum", "known"),
    "unknown flag": (["--colour", "red"], {}, "--colour", "--help"),
    "unreadable file": (["--config", "/nonexistent/kb.yaml"], {}, "config='/nonexistent/kb.yaml'", "cannot read"),
    "tls half": (["--tls-cert", "/etc/hostname"], {}, "tls_key", "together"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_setting_exits_2_with_one_line(case: str) -> None:
    args, env, names, accepted = BAD_CASES[case]
    result = run_cli("collect", *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert names in lines[0] and accepted in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("content,names,accepted", [
    ("interval: 1s\ncolour: red\n", "colour", "unknown key"),
    ("simulate: [1, 2]\n", "simulate=[1, 2]", "whole number"),
    ("interval: 1s\n  listen: [\n", "config=", "YAML syntax error at line"),
    ("- just\n- a list\n", "config=", "mapping"),
    ("interval: soon\n", "interval='soon'", "duration"),
])
def test_bad_config_file_exits_2_with_one_line(tmp_path: Path, content: str, names: str, accepted: str) -> None:
    file = tmp_path / "kb.yaml"
    file.write_text(content)
    result = run_cli("collect", "--config", str(file))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert names in line and accepted in line, line
    assert str(file) in line


def test_config_file_from_env(tmp_path: Path) -> None:
    file = tmp_path / "kb.json"
    file.write_text('{"interval": "7s"}')
    assert load({}, {"KEPLER_BRIDGE_CONFIG": str(file)}).interval == 7.0
    with pytest.raises(ConfigError, match="JSON syntax error"):
        file.write_text('{"interval": ')
        load({}, {"KEPLER_BRIDGE_CONFIG": str(file)})
