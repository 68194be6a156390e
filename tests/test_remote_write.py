"""Remote write through an outage (issue 19, point 1): the agent (2 simulated GPUs) -> the shipped
Prometheus agent (manifests/kubeedge/remote-write/: its flags, template and init script) -> two
cloud receivers at once, Debian's VictoriaMetrics and a Prometheus with the remote-write receiver,
each over HTTPS with basic auth behind a loopback proxy. Both links are cut for 2 minutes, then
restored: each receiver must hold every scrape of the outage, and the WAL must stay in its bound.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest
import requests
import yaml

from agent import Agent
from assets import generator
from promserver import binary
from remote_write_rig import (
    NODE,
    PASSWORD,
    USER,
    PrometheusAgent,
    PrometheusReceiver,
    Series,
    TcpProxy,
    Tls,
    VictoriaMetrics,
    render_config,
    seconds,
)
from scaffold import free_port, wait_for

pytestmark = pytest.mark.e2e

INTERVAL = 5.0
# Prometheus offsets each scrape within its interval by a fixed amount; the tolerance covers a
# scrape that starts late on a loaded machine.
TOLERANCE = 1.5
OUTAGE = 121.0
METRICS = ("gpu_energy_joules_total", "kepler_bridge_last_sample_timestamp_seconds")


def _shipped() -> ModuleType:
    """manifests/remote_write.py, where the WAL's bounds are set."""
    return generator("manifests/remote_write.py")


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[dict]:
    """Receivers, proxies, the agent and the Prometheus agent, all on loopback."""
    tls = Tls(tmp_path / "pki")
    started: list = []
    proxies: dict[str, TcpProxy] = {}
    try:
        receivers = {}
        for name, kind in (
            ("victoria-metrics", VictoriaMetrics),
            ("prometheus", PrometheusReceiver),
        ):
            (tmp_path / name).mkdir()
            receivers[name] = kind(tmp_path / name, tls)
            started.append(receivers[name])
        proxies |= {name: TcpProxy(receiver.port) for name, receiver in receivers.items()}
        agent = Agent("--simulate", "2", "--node-name", NODE)
        agent.__enter__()
        started.append(agent)
        urls = [f"https://127.0.0.1:{proxy.port}/api/v1/write" for proxy in proxies.values()]
        secret = {"username": USER, "password": PASSWORD, "ca.crt": tls.ca.read_text()}
        (tmp_path / "edge").mkdir()
        config = render_config(tmp_path / "edge", f"127.0.0.1:{agent.port}", "5s", urls, secret)
        writer = PrometheusAgent(tmp_path / "edge", config)
        started.append(writer)
        yield {"receivers": receivers, "proxies": proxies, "writer": writer}
    finally:
        for thing in reversed(started):
            thing.stop()
        for proxy in proxies.values():
            proxy.close()


def _gaps(series: Series, start: float, end: float) -> list[str]:
    """What is wrong with each series between start and end: no sample within an interval of
    either end, or two samples further apart than an interval."""
    wrong = []
    for key, times in series.items():
        times = sorted(t for t in times if start - INTERVAL <= t <= end + INTERVAL)
        label = dict(key).get("gpu", dict(key).get("__name__", "?"))
        slack = INTERVAL + TOLERANCE
        if not times or times[0] > start + slack or times[-1] < end - slack:
            wrong.append(f"{label}: samples {times[:1]}..{times[-1:]} do not span {start}..{end}")
            continue
        worst = max(b - a for a, b in zip(times, times[1:]))
        if worst > INTERVAL + TOLERANCE:
            wrong.append(f"{label}: a gap of {worst:.1f} s")
    return wrong


def test_every_scrape_of_a_two_minute_outage_reaches_both_receivers(rig: dict) -> None:
    receivers, proxies, writer = rig["receivers"], rig["proxies"], rig["writer"]
    remote = _shipped()
    # Both receivers hold data before the cut: the link works.
    for name, receiver in receivers.items():
        wait_for(
            lambda: receiver.series(METRICS[1], time.time() - 60, time.time()),
            40,
            f"{name} to receive",
        )
    wal_at_cut = writer.wal_bytes()
    cut = time.time()
    for proxy in proxies.values():
        proxy.cut()
    wal_most = wal_at_cut
    while time.time() < cut + OUTAGE:
        wal_most = max(wal_most, writer.wal_bytes())
        writer.check_alive()
        time.sleep(2)
    # Nothing arrived during the cut: it was a real outage.
    for name, receiver in receivers.items():
        late = receiver.series(METRICS[1], cut + INTERVAL + 1, time.time())
        assert not any(late.values()), f"{name} received during the outage"
    restored = time.time()
    for proxy in proxies.values():
        proxy.restore()
    for name, receiver in receivers.items():
        wait_for(
            lambda: all(
                max(times, default=0) > restored + INTERVAL
                for metric in METRICS
                for times in receiver.series(metric, cut - 30, time.time()).values()
            ),
            60,
            f"{name} to catch up",
        )
    start, end = cut - INTERVAL, restored + INTERVAL
    for name, receiver in receivers.items():
        for metric in METRICS:
            series = receiver.series(metric, start - 30, end + 30)
            expected = 2 if metric == METRICS[0] else 1
            assert len(series) == expected, f"{name} {metric}: {list(series)}"
            assert all(dict(key)["node"] == NODE for key in series), series.keys()
            assert not _gaps(series, start, end), f"{name} {metric}: {_gaps(series, start, end)}"
    limit = _bytes(remote.WAL_SIZE_LIMIT)
    assert wal_most < limit
    # The growth of the outage, kept for max-time plus a truncation period, twice over while a
    # checkpoint is written, still fits the emptyDir: the pod is never evicted for its WAL. This
    # test's 2 GPUs at 5 s write about as many samples a second as 8 GPUs at the shipped 15 s.
    per_hour = (wal_most - wal_at_cut) / OUTAGE * 3600
    held = seconds(remote.MAX_TIME) / 3600 + remote.TRUNCATE_HOURS
    assert 2 * per_hour * held + wal_at_cut < limit, f"WAL grows {per_hour / 1e6:.1f} MB/h"
    assert writer.metric("prometheus_remote_storage_samples_failed_total") == 0


def test_shipped_image_is_the_prometheus_this_test_runs() -> None:
    version = subprocess.run(
        [binary("prometheus"), "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    found = re.match(r"prometheus, version (\d+\.\d+\.\d+)", version)
    assert found, version
    assert _shipped().PROMETHEUS_IMAGE.endswith(f":v{found.group(1)}")


@pytest.mark.parametrize(
    "secret,wanted",
    [
        (
            {"token": "t0ken", "tenant": "edge-fleet"},
            {
                "authorization": {"credentials_file": "{dir}/token"},
                "headers": {"X-Scope-OrgID": "edge-fleet"},
            },
        ),
        (
            {"username": USER, "password": PASSWORD, "tls.crt": "c", "tls.key": "k"},
            {
                "basic_auth": {"username": USER, "password_file": "{dir}/password"},
                "tls_config": {
                    "cert_file": "{dir}/tls.crt",
                    "key_file": "{dir}/tls.key",
                    "insecure_skip_verify": False,
                },
            },
        ),
    ],
    ids=["bearer-token-and-tenant", "basic-auth-and-client-certificate"],
)
def test_init_script_writes_a_configuration_promtool_accepts(
    tmp_path: Path, secret: dict[str, str], wanted: dict
) -> None:
    url = "https://metrics.example.net/api/v1/write"
    config = render_config(tmp_path, "127.0.0.1:30060", "15s", [url], secret)
    (entry,) = yaml.safe_load(config.read_text())["remote_write"]
    assert entry["url"] == url
    for key, value in wanted.items():
        assert entry[key] == json.loads(
            json.dumps(value).replace("{dir}", str(tmp_path / "secret-0"))
        )
    checked = subprocess.run(
        [binary("promtool"), "check", "config", str(config)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    "url,secret,message",
    [
        ("http://metrics.example.net/api/v1/write", {"token": "t"}, "must start with https://"),
        ("https://metrics.example.net/api/v1/write", {}, "needs key token, or keys username"),
        ('https://a.example/"x', {"token": "t"}, "percent-encode it"),
        ("https://edge:pw@a.example/api/v1/write", {"token": "t"}, "holds a user or password"),
    ],
    ids=["plain-http", "no-credentials", "quote-in-url", "password-in-url"],
)
def test_init_script_refuses_a_secret_it_cannot_use_and_says_why(
    tmp_path: Path, url: str, secret: dict[str, str], message: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as failed:
        render_config(tmp_path, "127.0.0.1:30060", "15s", [url], secret)
    assert message in failed.value.stderr.decode()
    assert not (tmp_path / "init-output.yml").exists()


class _Limiting(BaseHTTPRequestHandler):
    """A receiver that rate-limits (429) until `Limiting.until`, then takes every batch."""

    until = 0.0
    posts: list[int] = []

    def do_POST(self) -> None:  # noqa: N802 (the handler's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status = 429 if time.monotonic() < self.until else 204
        self.posts.append(status)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_batches_a_rate_limiting_receiver_refuses_are_retried_not_dropped(tmp_path: Path) -> None:
    """Mimir, Cortex and Grafana Cloud answer 429 when a fleet sends its backlog after an outage:
    the shipped queue settings retry those batches (Prometheus 2.x drops them by default)."""
    shipped = _shipped()
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Limiting)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    _Limiting.until, _Limiting.posts = time.monotonic() + 12.0, []
    listen = f"127.0.0.1:{free_port()}"
    config = shipped.prometheus_config(listen)  # it scrapes itself: samples to send at once
    config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s"}
    config["remote_write"][0]["url"] = f"http://127.0.0.1:{receiver.server_address[1]}/write"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    args = shipped.prometheus_args(listen, str(tmp_path / "wal"), str(tmp_path / "prometheus.yml"))
    with (tmp_path / "log").open("w") as log:
        process = subprocess.Popen([binary("prometheus"), *args], stdout=log, stderr=log)
    try:
        wait_for(lambda: 204 in _Limiting.posts, 60, "a batch taken after the 429s")
        time.sleep(2)
        text = requests.get(f"http://{listen}/metrics", timeout=5).text
    finally:
        process.terminate()
        process.wait(10)
        receiver.shutdown()
    counts = {
        name: sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
        for name in (
            "prometheus_remote_storage_samples_failed_total",
            "prometheus_remote_storage_samples_retried_total",
        )
    }
    assert 429 in _Limiting.posts, "the receiver never refused a batch"
    assert counts["prometheus_remote_storage_samples_failed_total"] == 0, counts
    assert counts["prometheus_remote_storage_samples_retried_total"] > 0, counts
