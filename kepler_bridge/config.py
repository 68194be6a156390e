"""Settings: one table, read from flags > environment > config file > default."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import reprlib
import shlex
import shutil
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml


# A value in an error line: nested lists and long strings are cut, so the line stays short.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 120, 120


def one_line(text: str) -> str:
    """The text with line breaks and other control characters escaped, so that it prints as one line."""
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode() for char in text)


class ConfigError(Exception):
    """A setting has a value that is not accepted; the CLI exits 2 with this one line."""

    def __init__(self, setting: str, value: object, accepted: str, origin: str = "") -> None:
        where = f" (from {origin})" if origin else ""
        super().__init__(one_line(f"bad setting {setting}={_SHORT.repr(value)}{where}: {accepted}"))


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
# Linux's highest pid_max: no node has more processes than this.
MAX_PIDS = 1 << 22


def _number(value: object) -> float:
    """A finite number given as int, float or text; bools, nan and infinities are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    try:
        number = float(value)
    except OverflowError:
        raise ValueError from None
    if not math.isfinite(number):
        raise ValueError
    return number


def parse_duration(value: object) -> float:
    """Go-style duration (`500ms`, `1m30s`) or a plain number of seconds, as seconds."""
    if not isinstance(value, str):
        return _number(value)
    text = value.strip()
    try:
        return _number(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if not match:
            raise ValueError
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not text or not math.isfinite(total):
        raise ValueError
    return total


def _bounded(parse: Callable[[object], float], low: float, high: float) -> Callable[[object], float]:
    """A parser that accepts what `parse` accepts, from low to high."""
    def bounded(value: object) -> float:
        number = parse(value)
        if not low <= number <= high:
            raise ValueError
        return number
    return bounded


def _listen(value: object) -> tuple[str, int]:
    host, sep, port_text = _text(value).rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port_text) or not 0 < int(port_text) < 65536:
        raise ValueError
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    host = host or "0.0.0.0"
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ValueError from None
    return host, int(port_text)


def _name_list(value: object) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        if not all(isinstance(item, str) for item in value):
            raise ValueError
        items = value
    else:
        items = _text(value).split(",")
    names = tuple(item.strip() for item in items if item.strip())
    if not all(re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:.-]*", name) for name in names):
        raise ValueError
    return names


def _count(value: object) -> int:
    """A whole number >= 0 in decimal digits, given as int or text (no bool, float, sign or underscore)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError
    return int(text)


def _text(value: object) -> str:
    """Text as written, without surrounding blanks (a whole number reads as its digits); no control characters."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError
    text = str(value).strip()
    if not text.isprintable():
        raise ValueError
    return text


def _argv(value: object) -> tuple[str, ...]:
    """An executable and its arguments: a list (config file) or a string split like a shell would (flag, env)."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(item, str) and "\0" not in item for item in value):
            raise ValueError
        argv = tuple(value)
    else:
        argv = tuple(shlex.split(_text(value)))
    if argv and shutil.which(argv[0]) is None:
        raise ValueError
    return argv


def _memory_unit(value: object) -> str:
    text = _text(value)
    if text not in ("bytes", "KiB", "MiB"):
        raise ValueError
    return text


# Where Kubernetes mounts a pod's service-account token and the cluster CA.
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


_watts = _bounded(_number, 0, 100_000)


def _optional_watts(value: object) -> float | None:
    return None if isinstance(value, str) and value.strip() == "" else _watts(value)


def _process_metrics(value: object) -> int | None:
    """off -> 0 series, all -> None (no limit), top:N -> N."""
    text = _text(value)
    if text in ("off", "all"):
        return 0 if text == "off" else None
    match = re.fullmatch(r"top:([0-9]{1,7})", text)
    if not match or not 1 <= int(match.group(1)) <= MAX_PIDS:
        raise ValueError
    return int(match.group(1))


def _kube_source(value: object) -> str:
    text = _text(value)
    if text not in ("auto", "kubelet", "apiserver", "metaserver", "off"):
        raise ValueError
    return text


def _url(value: object) -> str:
    text = _text(value).rstrip("/")
    if text and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", text):
        raise ValueError
    return text


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).lower()
    if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError
    return text in ("true", "1", "yes", "on")


@dataclass(frozen=True)
class Setting:
    """One setting: its config-file key, flag, environment names, parser and default."""

    key: str
    envs: tuple[str, ...]
    parse: Callable[[object], Any]
    default: Any
    accepted: str
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting("listen", ("KEPLER_BRIDGE_LISTEN",), _listen, "0.0.0.0:30060",
            "expected HOST:PORT such as 0.0.0.0:30060, 127.0.0.1:9400 or [::]:30060",
            "address of /metrics and /v1/collect"),
    Setting("interval", ("KEPLER_BRIDGE_INTERVAL", "KEPLER_SAMPLING_INTERVAL"),
            _bounded(parse_duration, 0.1, 3600), "1s",
            "expected a duration from 100ms to 1h, such as 500ms, 5s, 1m, or a number of seconds",
            "sampling period"),
    Setting("node_name", ("KUBE_NODE_NAME",), _text, "",
            "expected a node name", "key of /v1/collect and the node label (default: hostname)"),
    Setting("sources", ("KEPLER_BRIDGE_SOURCES",), _name_list, ("auto",),
            "expected a comma list of source names such as nvml,ebpf or auto",
            "sources to read; auto = every source that works here"),
    Setting("metrics_allow", ("KEPLER_BRIDGE_METRICS_ALLOW",), _name_list, (),
            "expected a comma list of metric-name prefixes such as gpu_utilization,gpu_memory",
            "export only metrics whose name starts with one of these prefixes"),
    Setting("metrics_deny", ("KEPLER_BRIDGE_METRICS_DENY",), _name_list, (),
            "expected a comma list of metric-name prefixes", "never export metrics with these prefixes"),
    Setting("procfs", ("KEPLER_BRIDGE_PROCFS",), _text, "/proc",
            "expected a directory path", "host /proc root (in a pod: /host/proc)"),
    Setting("sysfs", ("KEPLER_BRIDGE_SYSFS",), _text, "/sys",
            "expected a directory path", "host /sys root (in a pod: /host/sys)"),
    Setting("nvml_library", ("KEPLER_BRIDGE_NVML_LIBRARY",), _text, "",
            "expected the path of libnvidia-ml.so.1", "explicit NVIDIA driver library path"),
    Setting("simulate", ("KEPLER_BRIDGE_SIMULATE",), _bounded(_count, 0, 1024), 0,
            "expected a whole number from 0 to 1024", "add N simulated accelerators"),
    Setting("simulate_seed", ("KEPLER_BRIDGE_SIMULATE_SEED",), _bounded(_count, 0, 2**32 - 1), 0,
            "expected a whole number from 0 to 4294967295", "seed of the simulated readings"),
    Setting("baetyl_memory_unit", ("KEPLER_BRIDGE_BAETYL_MEMORY_UNIT",), _memory_unit, "bytes",
            "expected one of bytes, KiB, MiB", "unit of memory values in /v1/collect"),
    Setting("max_processes", ("KEPLER_BRIDGE_MAX_PROCESSES",), _bounded(_count, 0, MAX_PIDS), 5000,
            f"expected a whole number from 0 (no cap) to {MAX_PIDS}", "cap on tracked processes (memory bound)"),
    Setting("process_grace", ("KEPLER_BRIDGE_PROCESS_GRACE",), _bounded(parse_duration, 0, 86400), "30s",
            "expected a duration from 0 to 24h, such as 30s or 2m", "how long an ended process keeps its series"),
    Setting("tls_cert", ("KEPLER_BRIDGE_TLS_CERT",), _text, "",
            "expected a PEM certificate path", "serve HTTPS with this certificate"),
    Setting("tls_key", ("KEPLER_BRIDGE_TLS_KEY",), _text, "",
            "expected a PEM key path", "private key of --tls-cert"),
    Setting("auth_token_file", ("KEPLER_BRIDGE_AUTH_TOKEN_FILE",), _text, "",
            "expected a readable file holding the bearer token", "require this bearer token on /metrics"),
    Setting("web_config_file", ("KEPLER_BRIDGE_WEB_CONFIG_FILE",), _text, "",
            "expected the path of a web config file in the Prometheus exporter-toolkit format",
            "TLS, client certificates and basic-auth users (exporter-toolkit format), re-read when it changes",
            aliases=("--web.config.file",)),
    Setting("http_header_timeout", ("KEPLER_BRIDGE_HTTP_HEADER_TIMEOUT",), _bounded(parse_duration, 0.5, 300), "5s",
            "expected a duration from 500ms to 5m, such as 5s",
            "time a client has to send a whole request head; a slower or silent connection is closed"),
    Setting("http_write_timeout", ("KEPLER_BRIDGE_HTTP_WRITE_TIMEOUT",), _bounded(parse_duration, 0.5, 600), "30s",
            "expected a duration from 500ms to 10m, such as 30s",
            "time a client may leave a response unread before its connection is closed"),
    Setting("ebpf_map_entries", ("KEPLER_BRIDGE_EBPF_MAP_ENTRIES",),
            _bounded(_count, 64, 1 << 22), 16384,
            "expected a whole number from 64 to 4194304",
            "size of the eBPF map of ended processes: thread groups that may end within one interval"),
    Setting("command", ("KEPLER_BRIDGE_COMMAND",), _argv, (),
            "expected an executable that exists, with its arguments: a list in the config file, a string split "
            "like a shell would on the flag or env (no shell runs it)",
            "run this executable each interval; it prints accelerator readings as JSON (docs/command-source.md)"),
    Setting("command_timeout", ("KEPLER_BRIDGE_COMMAND_TIMEOUT",), _bounded(parse_duration, 0.1, 600), "5s",
            "expected a duration from 100ms to 10m, such as 2s or 30s",
            "time limit of one run of --command and of npu-smi; past it all the run started is killed"),
    Setting("npu_smi", ("KEPLER_BRIDGE_NPU_SMI",), _text, "npu-smi",
            "expected the npu-smi executable: a path, or a name looked up in PATH and /usr/local/sbin",
            "Huawei Ascend npu-smi that the ascend source runs"),
    Setting("cpu_tdp_watts", ("KEPLER_BRIDGE_CPU_TDP_WATTS",), _watts, 0,
            "expected a number of watts from 0 to 100000, such as 65 (0 = no estimate)",
            "where RAPL is absent, estimate CPU power as this times CPU usage (0 = no CPU energy there)"),
    Setting("gpu_idle_watts", ("KEPLER_BRIDGE_GPU_IDLE_WATTS",), _optional_watts, "",
            "expected a number of watts from 0 to 100000, or empty for the lowest power seen",
            "idle power of each GPU: energy above it is shared by the GPU's processes (default: lowest seen)"),
    Setting("process_metrics", ("KEPLER_BRIDGE_PROCESS_METRICS",), _process_metrics, "top:50",
            f"expected off, all, or top:N with N from 1 to {MAX_PIDS}, such as top:50",
            "per-process energy series: none, all, or the N using most energy plus one pid=\"other\""),
    Setting("kube_source", ("KEPLER_BRIDGE_KUBE_SOURCE",), _kube_source, "auto",
            "expected one of auto, kubelet, apiserver, metaserver, off",
            "where pod names come from; auto tries the KubeEdge MetaServer, the kubelet, then the API server"),
    Setting("kubelet_url", ("KEPLER_BRIDGE_KUBELET_URL",), _url, "",
            "expected an http(s) URL such as https://10.0.0.5:10250",
            "the kubelet (default https://$NODE_IP:10250)"),
    Setting("metaserver_url", ("KEPLER_BRIDGE_METASERVER_URL",), _url, "http://127.0.0.1:10550",
            "expected an http(s) URL such as http://127.0.0.1:10550", "KubeEdge's edge MetaServer"),
    Setting("kube_token_file", ("KEPLER_BRIDGE_KUBE_TOKEN_FILE",), _text, f"{SERVICE_ACCOUNT}/token",
            "expected a file path", "bearer token for the kubelet and the API server (re-read at each refresh)"),
    Setting("kube_ca_file", ("KEPLER_BRIDGE_KUBE_CA_FILE",), _text, f"{SERVICE_ACCOUNT}/ca.crt",
            "expected a PEM file path", "CA that signed the kubelet's and the API server's certificates"),
    Setting("kube_insecure_skip_tls_verify", ("KEPLER_BRIDGE_KUBE_INSECURE_SKIP_TLS_VERIFY",), _flag, False,
            "expected true or false", "do not verify the kubelet's and API server's certificates"),
    Setting("pod_resources_socket", ("KEPLER_BRIDGE_POD_RESOURCES_SOCKET",), _text,
            "/var/lib/kubelet/pod-resources/kubelet.sock", "expected a unix socket path, or empty for none",
            "the kubelet's pod-resources socket: which pod each GPU is assigned to"),
)

_BY_KEY = {setting.key: setting for setting in SETTINGS}
# The seed's allow-list file: {"metrics": ["gpu_utilization", ...]}.
_FILE_ALIASES = {"metrics": "metrics_allow"}
# In the file a null value means "not set", except here: there it would silently serve without protection.
_NULL_REFUSED = ("auth_token_file", "tls_cert", "tls_key")
MAX_CONFIG_BYTES = 1 << 20
MAX_TOKEN_BYTES = 64 << 10


@dataclass(frozen=True)
class Config:
    """Validated settings of one agent run."""

    listen: tuple[str, int]
    interval: float
    node_name: str
    sources: tuple[str, ...]
    metrics_allow: tuple[str, ...]
    metrics_deny: tuple[str, ...]
    procfs: str
    sysfs: str
    nvml_library: str
    simulate: int
    simulate_seed: int
    baetyl_memory_unit: str
    max_processes: int
    process_grace: float
    tls_cert: str
    tls_key: str
    auth_token_file: str
    auth_token: bytes = field(repr=False)
    web_config_file: str
    http_header_timeout: float
    http_write_timeout: float
    ebpf_map_entries: int
    command: tuple[str, ...]
    command_timeout: float
    npu_smi: str
    cpu_tdp_watts: float
    gpu_idle_watts: float | None
    process_metrics: int | None
    kube_source: str
    kubelet_url: str
    metaserver_url: str
    kube_token_file: str
    kube_ca_file: str
    kube_insecure_skip_tls_verify: bool
    pod_resources_socket: str
    config_file: str
    # Where each setting's value came from (a flag, a variable, the file or "default"), for error lines.
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def listen_text(self) -> str:
        host, port = self.listen
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting, plus --config; defaults stay None so precedence works."""
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON config file (env KEPLER_BRIDGE_CONFIG)")
    for setting in SETTINGS:
        parser.add_argument(setting.flag, *setting.aliases, dest=setting.key,
                            metavar=setting.key.split("_")[-1].upper(),
                            help=f"{setting.help} (env {setting.envs[0]}, default {_show(setting.default)})")


def _show(default: object) -> str:
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default) if default != "" else "none"


_NULL, _INT = "tag:yaml.org,2002:null", "tag:yaml.org,2002:int"
_DECIMAL = re.compile(r"^(?:0|[1-9][0-9]{0,17})$")


class _ScalarsAsWritten(yaml.SafeLoader):
    """YAML that keeps a scalar's text: only null and decimal whole numbers get a type, so `interval: 1:30`
    stays "1:30" (not 90 seconds), `node_name: 0123` stays "0123" (not 83) and `yes` stays "yes"."""

    yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag == _NULL]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    yaml_constructors = {tag: yaml.SafeLoader.yaml_constructors[tag] for tag in (
        None, _NULL, "tag:yaml.org,2002:str", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map")}

    def construct_decimal(self, node: yaml.ScalarNode) -> int:
        """An int from decimal digits; an explicit `!!int` with anything else (0x10, 1:30) is refused."""
        text = self.construct_scalar(node)
        if not _DECIMAL.match(text):
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a whole number in decimal digits",
                                                    node.start_mark)
        return int(text)


_ScalarsAsWritten.add_implicit_resolver(_INT, _DECIMAL, list("0123456789"))
_ScalarsAsWritten.add_constructor(_INT, _ScalarsAsWritten.construct_decimal)


def read_file(path: str) -> dict[str, object]:
    """Read a YAML or JSON config file into a mapping of known keys; a null value counts as not set."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as err:
        raise ConfigError("config", path, f"cannot read the file: {err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("config", path, "larger than 1 MiB; a config file holds a few settings")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError("config", path, f"not UTF-8 text ({err.reason} at byte {err.start}); "
                                          "save it as UTF-8") from None
    data = _parse(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, "expected a mapping of setting names to values")
    known = sorted(set(_BY_KEY) | set(_FILE_ALIASES))
    result: dict[str, object] = {}
    for key, value in data.items():
        name = _FILE_ALIASES.get(key, key)
        if name not in _BY_KEY:
            raise ConfigError(f"{key} (in {path})", value, f"unknown key; accepted keys: {', '.join(known)}")
        if value is None and name in _NULL_REFUSED:
            raise ConfigError(name, value, "an empty value would turn it off; give the file's path, or delete "
                                           "the key to serve without it", path)
        if value is not None:
            result[name] = value
    return result


def _parse(path: str, text: str) -> object:
    """The document in a config file: JSON where the name ends in .json, else YAML."""
    try:
        return json.loads(text) if path.endswith(".json") else yaml.load(text, Loader=_ScalarsAsWritten)
    except json.JSONDecodeError as err:
        raise ConfigError("config", path, f"JSON syntax error at line {err.lineno}: {err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError("config", path, f"YAML syntax error{line}: {problem}") from None
    except RecursionError:
        raise ConfigError("config", path, "nested too deeply; a setting is a value or a flat list") from None
    except ValueError as err:  # JSON integers longer than Python converts (4300 digits)
        raise ConfigError("config", path, f"cannot read a number: {str(err).split(':')[0]}") from None


def _read_token(path: str, origin: str = "") -> bytes:
    """The bearer token in the file: one line of visible ASCII characters, surrounding blanks removed."""
    fix = "write one line of visible ASCII characters into it, such as the output of openssl rand -hex 32"
    try:
        with open(path, "rb") as file:
            token = file.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as err:
        raise ConfigError("auth_token_file", path, f"cannot read the file: {err.strerror or err}; give the path "
                                                   "of the file holding the bearer token", origin) from None
    if not token:
        raise ConfigError("auth_token_file", path, f"the file is empty, so no token would be required; {fix}, "
                                                   "or leave the setting unset to serve /metrics without one",
                          origin)
    if len(token) > MAX_TOKEN_BYTES:
        raise ConfigError("auth_token_file", path, f"larger than 64 KiB, not a bearer token; {fix}", origin)
    if not re.fullmatch(rb"[\x21-\x7e]+", token):
        raise ConfigError("auth_token_file", path, "the token has blanks, line breaks or non-ASCII characters "
                                                   f"inside (a bearer token is visible ASCII, RFC 6750); {fix}", origin)
    return token


def load(flags: Mapping[str, object], environ: Mapping[str, str] | None = None) -> Config:
    """Resolve every setting by precedence flag > env > file > default, and validate it."""
    environ = os.environ if environ is None else environ
    config_file = flags.get("config") or environ.get("KEPLER_BRIDGE_CONFIG") or ""
    from_file = read_file(str(config_file)) if config_file else {}
    values: dict[str, object] = {}
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
        raise ConfigError("tls_key" if values["tls_cert"] else "tls_cert", "",
                          "--tls-cert and --tls-key must be given together")
    token_file = str(values["auth_token_file"])
    token = _read_token(token_file, origins["auth_token_file"]) if token_file else b""
    return Config(config_file=str(config_file), auth_token=token, origins=origins, **values)


def _pick(setting: Setting, flags: Mapping[str, object], environ: Mapping[str, str],
          from_file: Mapping[str, object], config_file: str) -> tuple[object, str]:
    if flags.get(setting.key) is not None:
        return flags[setting.key], setting.flag
    for env in setting.envs:
        if environ.get(env, "") != "":
            return environ[env], env
    if setting.key in from_file:
        return from_file[setting.key], config_file
    return setting.default, "default"
