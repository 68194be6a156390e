"""The settings table: one field per setting, with its variables, parser, default and help.

`kepler_bridge.config.Config` extends it with what `load` adds; `config.SETTINGS` is made from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kepler_bridge import settings_parse as parse

# Where Kubernetes mounts a pod's service-account token and the cluster CA.
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class SettingsTable:
    """Every setting, in the order of the table; each field's metadata is its row."""

    listen: tuple[str, int] = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_LISTEN",),
            parse.listen,
            ":30060",
            "expected HOST:PORT such as :30060 (every address), 127.0.0.1:9400 or [::1]:30060",
            "address of /metrics and /v1/collect",
        )
    )
    interval: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_INTERVAL", "KEPLER_SAMPLING_INTERVAL"),
            parse.bounded(parse.duration, 0.1, 3600),
            "1s",
            "expected a duration from 100ms to 1h, such as 500ms, 5s, 1m, or a number of seconds",
            "sampling period",
        )
    )
    node_name: str = field(
        metadata=parse.setting(
            ("KUBE_NODE_NAME",),
            parse.printable,
            "",
            "expected a node name",
            "key of /v1/collect and the node label (default: hostname)",
        )
    )
    sources: tuple[str, ...] = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_SOURCES",),
            parse.name_list,
            ("auto",),
            "expected a comma list of source names such as nvml,ebpf or auto",
            "sources to read; auto = every source that works here",
        )
    )
    metrics_allow: tuple[str, ...] = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_METRICS_ALLOW",),
            parse.name_list,
            (),
            "expected a comma list of metric-name prefixes such as gpu_utilization,gpu_memory",
            "export only metrics whose name starts with one of these prefixes",
        )
    )
    metrics_deny: tuple[str, ...] = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_METRICS_DENY",),
            parse.name_list,
            (),
            "expected a comma list of metric-name prefixes",
            "never export metrics with these prefixes",
        )
    )
    metric_names: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_METRIC_NAMES",),
            parse.one_of("kepler", "dcgm"),
            "kepler",
            "expected one of kepler, dcgm",
            "names of the accelerator series on /metrics: ours, or dcgm-exporter's DCGM_FI_* "
            "names, units and labels",
        )
    )
    procfs: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_PROCFS",),
            parse.printable,
            "/proc",
            "expected a directory path",
            "host /proc root (in a pod: /host/proc)",
        )
    )
    sysfs: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_SYSFS",),
            parse.printable,
            "/sys",
            "expected a directory path",
            "host /sys root (in a pod: /host/sys)",
        )
    )
    nvml_library: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_NVML_LIBRARY",),
            parse.printable,
            "",
            "expected the path of libnvidia-ml.so.1",
            "explicit NVIDIA driver library path",
        )
    )
    nvml_reprobe_interval: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_NVML_REPROBE_INTERVAL",),
            parse.bounded(parse.duration, 0.1, 86400),
            "60s",
            "expected a duration from 100ms to 24h, such as 60s or 5m",
            "how long before a value NVML said a GPU cannot report is asked again; "
            "doubling while it still cannot, up to 10 times this",
        )
    )
    nvml_counter_interval: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_NVML_COUNTER_INTERVAL",),
            parse.bounded(parse.duration, 0, 3600),
            "10s",
            "expected a duration from 0 to 1h, such as 10s or 1m",
            "how often NVML's slow counters are read (ECC errors, remapped rows, retired pages, "
            "PCIe replays, NVLink errors, clock-event time), PCIe throughput (20 ms of waiting "
            "a call) and the MIG mode of a GPU out of it, their last values exported in "
            "between; 0 = every sample",
        )
    )
    simulate: int = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_SIMULATE",),
            parse.bounded(parse.count, 0, 1024),
            0,
            "expected a whole number from 0 to 1024",
            "add N simulated accelerators",
        )
    )
    simulate_seed: int = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_SIMULATE_SEED",),
            parse.bounded(parse.count, 0, 2**32 - 1),
            0,
            "expected a whole number from 0 to 4294967295",
            "seed of the simulated readings",
        )
    )
    baetyl_memory_unit: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_BAETYL_MEMORY_UNIT",),
            parse.one_of("bytes", "KiB", "MiB"),
            "bytes",
            "expected one of bytes, KiB, MiB",
            "unit of memory values in /v1/collect",
        )
    )
    max_processes: int = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_MAX_PROCESSES",),
            parse.bounded(parse.count, 0, parse.MAX_PIDS),
            5000,
            f"expected a whole number from 0 (no cap) to {parse.MAX_PIDS}",
            "cap on tracked processes (memory bound)",
        )
    )
    process_grace: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_PROCESS_GRACE",),
            parse.bounded(parse.duration, 0, 86400),
            "30s",
            "expected a duration from 0 to 24h, such as 30s or 2m",
            "how long an ended process keeps its series",
        )
    )
    device_grace: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_DEVICE_GRACE",),
            parse.bounded(parse.duration, 0, 86400),
            "5m",
            "expected a duration from 0 to 24h, such as 5m or 30s",
            "how long a device the sources stopped listing keeps its counters and series",
        )
    )
    tls_cert: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_TLS_CERT",),
            parse.printable,
            "",
            "expected a PEM certificate path",
            "serve HTTPS with this certificate",
        )
    )
    tls_key: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_TLS_KEY",),
            parse.printable,
            "",
            "expected a PEM key path",
            "private key of --tls-cert",
        )
    )
    auth_token_file: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_AUTH_TOKEN_FILE",),
            parse.printable,
            "",
            "expected a readable file holding the bearer token",
            "require this bearer token on /metrics",
        )
    )
    web_config_file: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_WEB_CONFIG_FILE",),
            parse.printable,
            "",
            "expected the path of a web config file in the Prometheus exporter-toolkit format",
            "TLS, client certificates and basic-auth users (exporter-toolkit format), "
            "re-read when it changes",
            aliases=("--web.config.file",),
        )
    )
    http_header_timeout: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_HTTP_HEADER_TIMEOUT",),
            parse.bounded(parse.duration, 0.5, 300),
            "5s",
            "expected a duration from 500ms to 5m, such as 5s",
            "time a client has to send a whole request head; "
            "a slower or silent connection is closed",
        )
    )
    http_write_timeout: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_HTTP_WRITE_TIMEOUT",),
            parse.bounded(parse.duration, 0.5, 600),
            "30s",
            "expected a duration from 500ms to 10m, such as 30s",
            "time a client may leave a response unread before its connection is closed",
        )
    )
    ebpf_map_entries: int = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_EBPF_MAP_ENTRIES",),
            parse.bounded(parse.count, 64, 1 << 22),
            16384,
            "expected a whole number from 64 to 4194304",
            "size of the eBPF map of ended processes: "
            "thread groups that may end within one interval",
        )
    )
    command: tuple[str, ...] = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_COMMAND",),
            parse.argv,
            (),
            "expected an executable that exists, with its arguments: a list in the config file, "
            "a string split like a shell would on the flag or env (no shell runs it)",
            "run this executable each interval; it prints accelerator readings as JSON "
            "(docs/command-source.md)",
        )
    )
    command_timeout: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_COMMAND_TIMEOUT",),
            parse.bounded(parse.duration, 0.1, 600),
            "5s",
            "expected a duration from 100ms to 10m, such as 2s or 30s",
            "time limit of one run of --command and of npu-smi; "
            "past it all the run started is killed",
        )
    )
    npu_smi: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_NPU_SMI",),
            parse.printable,
            "npu-smi",
            "expected the npu-smi executable: "
            "a path, or a name looked up in PATH and /usr/local/sbin",
            "Huawei Ascend npu-smi that the ascend source runs",
        )
    )
    cpu_tdp_watts: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_CPU_TDP_WATTS",),
            parse.watts,
            0,
            "expected a number of watts from 0 to 100000, such as 65 (0 = no estimate)",
            "where RAPL is absent, estimate CPU power as this times CPU usage "
            "(0 = no CPU energy there)",
        )
    )
    gpu_idle_watts: float | None = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_GPU_IDLE_WATTS",),
            parse.optional_watts,
            "",
            "expected a number of watts from 0 to 100000, or empty for the lowest power seen",
            "idle power of each GPU: energy above it is shared by the GPU's processes "
            "(default: lowest seen)",
        )
    )
    process_metrics: int | None = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_PROCESS_METRICS",),
            parse.process_metrics,
            "top:50",
            f"expected off, all, or top:N with N from 1 to {parse.MAX_PIDS}, such as top:50",
            'per-process energy series: none, all, or the N using most energy plus one pid="other"',
        )
    )
    kube_source: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_SOURCE",),
            parse.one_of("auto", "kubelet", "apiserver", "metaserver", "off"),
            "auto",
            "expected one of auto, kubelet, apiserver, metaserver, off",
            "where pod names come from; auto tries the KubeEdge MetaServer, the kubelet, "
            "then the API server",
        )
    )
    kubelet_url: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBELET_URL",),
            parse.url,
            "",
            "expected an http(s) URL such as https://10.0.0.5:10250",
            "the kubelet (default https://$NODE_IP:10250)",
        )
    )
    metaserver_url: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_METASERVER_URL",),
            parse.url,
            "http://127.0.0.1:10550",
            "expected an http(s) URL such as http://127.0.0.1:10550",
            "KubeEdge's edge MetaServer",
        )
    )
    kube_token_file: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_TOKEN_FILE",),
            parse.printable,
            f"{SERVICE_ACCOUNT}/token",
            "expected a file path",
            "bearer token for the kubelet and the API server (re-read at each refresh)",
        )
    )
    kube_ca_file: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_CA_FILE",),
            parse.printable,
            f"{SERVICE_ACCOUNT}/ca.crt",
            "expected a PEM file path",
            "CA that signed the kubelet's and the API server's certificates",
        )
    )
    kube_insecure_skip_tls_verify: bool = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_INSECURE_SKIP_TLS_VERIFY",),
            parse.flag,
            False,
            "expected true or false",
            "do not verify the kubelet's and API server's certificates",
        )
    )
    pod_resources_socket: str = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_POD_RESOURCES_SOCKET",),
            parse.printable,
            "/var/lib/kubelet/pod-resources/kubelet.sock",
            "expected a unix socket path, or empty for none",
            "the kubelet's pod-resources socket: which pod each GPU is assigned to",
        )
    )
    kube_max_reply_bytes: int = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_MAX_REPLY_BYTES",),
            parse.bounded(parse.count, 1 << 16, 1 << 30),
            16 << 20,
            "expected a whole number of bytes from 65536 to 1073741824, such as 33554432",
            "largest reply read from a kube endpoint (pod list, pod-resources); a longer one is "
            "refused unread and the last good one stays",
        )
    )
    kube_timeout: float = field(
        metadata=parse.setting(
            ("KEPLER_BRIDGE_KUBE_TIMEOUT",),
            parse.bounded(parse.duration, 0.1, 300),
            "10s",
            "expected a duration from 100ms to 5m, such as 10s",
            "time one request to a kube endpoint may take in all (connect, TLS, reply); "
            "past it the request is cut and the last good answer stays",
        )
    )
