"""Remote write on loopback: the shipped Prometheus agent (manifests/kubeedge/remote-write/),
cloud receivers (VictoriaMetrics, Prometheus) over TLS with basic auth, and a TCP proxy between
them that counts bytes and can cut the link."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import bcrypt
import requests
import yaml

from pki import Authority
from promserver import Daemon, binary
from scaffold import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "manifests" / "kubeedge" / "remote-write"
USER, PASSWORD = "edge", "s3cret-edge"
NODE = "edge-node-1"
Series = dict[tuple[tuple[str, str], ...], list[float]]


class TcpProxy:
    """Forwards loopback connections to `upstream`; cut() drops the link (open connections are
    reset, new ones closed at once) until restore(). Counts the bytes each way."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sent = 0
        self.received = 0
        self.cut_off = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.cut_off:
                _reset(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if self.cut_off:
                    break
                sink.sendall(chunk)
                with self._lock:
                    if upstream:
                        self.sent += len(chunk)
                    else:
                        self.received += len(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            _reset(sock)
            with self._lock:
                self._open.discard(sock)

    def cut(self) -> None:
        """Drop the link: every open connection is reset, new ones are refused."""
        self.cut_off = True
        with self._lock:
            for sock in list(self._open):
                _reset(sock)

    def restore(self) -> None:
        self.cut_off = False

    def close(self) -> None:
        self.cut()
        self._server.close()


def _reset(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class Tls:
    """A CA and a server certificate for 127.0.0.1, signed by it."""

    def __init__(self, directory: Path) -> None:
        authority = Authority(directory)
        self.ca = authority.cert
        self.cert, self.key = authority.issue("receiver", "IP:127.0.0.1")


class Receiver(Daemon):
    """A cloud receiver of remote write on 127.0.0.1, HTTPS with basic auth."""

    url: str
    tls: Tls

    def _get(self, path: str, **params: Any) -> requests.Response:
        self.check_alive()
        answer = requests.get(
            self.url + path,
            params=params,
            auth=(USER, PASSWORD),
            verify=str(self.tls.ca),
            timeout=10,
        )
        answer.raise_for_status()
        return answer


class VictoriaMetrics(Receiver):
    """Debian's single-node VictoriaMetrics, HTTPS with basic auth."""

    def __init__(self, workdir: Path, tls: Tls) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.tls = tls
        super().__init__(
            [
                binary("victoria-metrics"),
                f"-httpListenAddr=127.0.0.1:{self.port}",
                f"-storageDataPath={workdir / 'vm-data'}",
                "-retentionPeriod=1d",
                "-tls",
                f"-tlsCertFile={tls.cert}",
                f"-tlsKeyFile={tls.key}",
                f"-httpAuth.username={USER}",
                f"-httpAuth.password={PASSWORD}",
                "-search.disableCache",
                "-search.latencyOffset=0s",
                "-loggerLevel=WARN",
            ],
            workdir,
            "victoria-metrics",
        )
        wait_for(self._ready, 30, "VictoriaMetrics to answer", step=0.25, ignore=(OSError,))

    def _ready(self) -> bool:
        return self._get("/health").ok

    def series(self, name: str, start: float, end: float) -> Series:
        """Each series of `name`: its sample times (s) from start to end."""
        text = self._get("/api/v1/export", **{"match[]": name, "start": start, "end": end}).text
        found: Series = {}
        for line in filter(None, text.splitlines()):
            row = json.loads(line)
            found[_key(row["metric"])] = [t / 1000 for t in row["timestamps"]]
        return found


class PrometheusReceiver(Receiver):
    """A Prometheus server that takes remote write (--web.enable-remote-write-receiver), HTTPS
    with basic auth."""

    def __init__(self, workdir: Path, tls: Tls) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.tls = tls
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
        web = {
            "tls_server_config": {"cert_file": str(tls.cert), "key_file": str(tls.key)},
            "basic_auth_users": {USER: hashed},
        }
        (workdir / "web.yml").write_text(yaml.safe_dump(web))
        # As manifests/README.md advises: a fleet's backlog after an outage is older than the head.
        storage = {"tsdb": {"out_of_order_time_window": "24h"}}
        (workdir / "receiver.yml").write_text(yaml.safe_dump({"storage": storage}))
        super().__init__(
            [
                binary("prometheus"),
                "--config.file=receiver.yml",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.config.file=web.yml",
                "--web.enable-remote-write-receiver",
                "--log.level=warn",
            ],
            workdir,
            "prometheus-receiver",
        )
        wait_for(
            self._ready, 30, "the Prometheus receiver to be ready", step=0.25, ignore=(OSError,)
        )

    def _ready(self) -> bool:
        return self._get("/-/ready").ok

    def series(self, name: str, start: float, end: float) -> Series:
        """Each series of `name`: its raw sample times (s) from start to end."""
        seconds = int(end - start) + 1
        data = self._get("/api/v1/query", query=f"{name}[{seconds}s]", time=end).json()["data"]
        return {_key(row["metric"]): [float(t) for t, _ in row["values"]] for row in data["result"]}


def _key(metric: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(metric.items()))


def shipped(name: str) -> dict[str, Any]:
    """The one object in a file of manifests/kubeedge/remote-write/."""
    (doc,) = [doc for doc in yaml.safe_load_all((SHIPPED / name).read_text()) if doc]
    return doc


def render_config(
    workdir: Path, target: str, interval: str, urls: list[str], secret: dict[str, str]
) -> Path:
    """prometheus.yml as the shipped init container writes it from the shipped template, with
    this test's scrape target and interval, `secret` as the Secret's files, one remote_write
    entry per url."""
    template = yaml.safe_load(shipped("10-configmap.yaml")["data"]["prometheus.yml"])
    template["global"]["scrape_interval"] = interval
    template["global"]["scrape_timeout"] = min(interval, "5s", key=seconds)
    (job,) = template["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    (workdir / "template.yml").write_text(yaml.safe_dump(template, sort_keys=False))
    entries = []
    for number, url in enumerate(urls):
        rendered = yaml.safe_load(_run_init(workdir / f"secret-{number}", url, secret))
        (entry,) = rendered["remote_write"]
        entries.append(entry | {"name": f"{entry['name']}-{number}"})
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(rendered | {"remote_write": entries}, sort_keys=False))
    return config


def _run_init(secret_dir: Path, url: str, secret: dict[str, str]) -> str:
    """What the shipped init container writes, `secret` and `url` as the Secret's files."""
    workdir = secret_dir.parent
    secret_dir.mkdir()
    for key, value in {"url": url, **secret}.items():
        (secret_dir / key).write_text(value)
    (init,) = shipped("30-daemonset.yaml")["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value", "") for e in init["env"]}
    env |= {
        "REMOTE_WRITE_SECRET_DIR": str(secret_dir),
        "REMOTE_WRITE_TEMPLATE": str(workdir / "template.yml"),
        "PROMETHEUS_CONFIG": str(workdir / "init-output.yml"),
        "KUBE_NODE_NAME": NODE,
        "PATH": "/usr/bin:/bin",
    }
    _, flag, script = init["command"]
    subprocess.run(["sh", flag, script], env=env, check=True, timeout=30, capture_output=True)
    return (workdir / "init-output.yml").read_text()


def seconds(duration: str) -> float:
    """A Prometheus duration of one unit (5s, 24h) in seconds."""
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


class PrometheusAgent(Daemon):
    """Debian's Prometheus with the shipped container's flags (agent mode, WAL bounds); only the
    paths and the listen address are this test's."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.wal = workdir / "agent-data"
        (container,) = shipped("30-daemonset.yaml")["spec"]["template"]["spec"]["containers"]
        local = {
            "--config.file": str(config),
            "--storage.agent.path": str(self.wal),
            "--web.listen-address": f"127.0.0.1:{self.port}",
        }
        args = [
            f"{flag}={local[flag]}" if flag in local else arg
            for arg in container["args"]
            for flag in [arg.split("=", 1)[0]]
        ]
        super().__init__([binary("prometheus"), *args, "--log.level=warn"], workdir, "agent")
        wait_for(self._ready, 30, "the Prometheus agent to be ready", step=0.25, ignore=(OSError,))

    def _ready(self) -> bool:
        self.check_alive()
        return requests.get(f"{self.url}/-/ready", timeout=5).ok

    def metric(self, name: str) -> float:
        """The sum of one of Prometheus' own metrics over its series."""
        text = requests.get(f"{self.url}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in "{ "
        )

    def cpu_seconds(self) -> float:
        """User and system CPU time Prometheus has used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        """Prometheus' resident memory now."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
        return int(line.split()[1]) * 1024

    def wal_bytes(self) -> int:
        """The size of the WAL directory now."""
        return sum(path.stat().st_size for path in self.wal.rglob("*") if path.is_file())
