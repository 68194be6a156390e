"""Debian's Prometheus and Alertmanager, and HTTP stubs, on loopback for tests.

The stubs: a webhook receiver and a MetaServer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from scaffold import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "alerts" / "gpu-alerts.rules.yml"


def binary(name: str) -> str:
    """Path of a Debian Prometheus tool; fails the test (never skips) when it is missing."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(
            f"{name} is not installed: run `make deps` "
            "(apt-get install prometheus prometheus-alertmanager victoria-metrics)",
            pytrace=False,
        )
    return path


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """Body of a GET; raises OSError on any failure."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


class Daemon:
    """A subprocess whose output goes to a log file and that is always killed at stop()."""

    def __init__(self, args: list[str], workdir: Path, name: str) -> None:
        self.log = workdir / f"{name}.log"
        self.name = name
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            args,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
        )

    def check_alive(self) -> None:
        """Fail with the tail of the log when the process has exited."""
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            pytest.fail(
                f"{self.name} exited with {self.process.returncode}:\n{tail}", pytrace=False
            )

    def stop(self) -> None:
        """Terminate, then kill if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()


class Prometheus(Daemon):
    """A Prometheus server scraping the static targets every second with the gpu-alerts rules."""

    def __init__(
        self, workdir: Path, jobs: dict[str, list[str]], alertmanager: str | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        }
        if alertmanager:
            config["alerting"] = {
                "alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]
            }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        super().__init__(
            [
                binary("prometheus"),
                "--config.file=prometheus.yml",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            workdir,
            "prometheus",
        )
        wait_for(self._ready, 30, "Prometheus to be ready", step=0.25, ignore=(OSError,))

    def _ready(self) -> bool:
        self.check_alive()
        return http_get(f"{self.url}/-/ready") is not None

    def api(self, path: str, **params: str) -> Any:
        """The `data` of a successful Prometheus HTTP API answer."""
        query = urllib.parse.urlencode(params)
        answer = json.loads(http_get(f"{self.url}/api/v1/{path}?{query}"))
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant vector result of a PromQL expression."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [data["result"]]

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        """Alerts of that name in state firing."""
        return [
            alert
            for alert in self.api("alerts")["alerts"]
            if alert["labels"]["alertname"] == alertname and alert["state"] == "firing"
        ]


class HttpStub:
    """An HTTP receiver on loopback (Alertmanager's webhook): keeps the JSON body of every POST."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0"))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                """Keep the test output clean."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, alertname: str, status: str = "firing") -> list[dict[str, Any]]:
        """Alerts of that name and status in the Alertmanager notifications received so far."""
        return [
            alert
            for notification in list(self.received)
            for alert in notification.get("alerts", [])
            if alert["labels"].get("alertname") == alertname and alert["status"] == status
        ]

    def stop(self) -> None:
        """Shut the server down."""
        self.server.shutdown()
        self.server.server_close()


class Alertmanager(Daemon):
    """An Alertmanager without clustering that sends every alert to one webhook, grouped for 1 s."""

    def __init__(self, workdir: Path, webhook_url: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = {
            "route": {
                "receiver": "test",
                "group_by": ["alertname"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [
                {"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}
            ],
        }
        (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        super().__init__(
            [
                binary("prometheus-alertmanager"),
                "--config.file=alertmanager.yml",
                f"--storage.path={workdir / 'am-data'}",
                f"--web.listen-address={self.address}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            workdir,
            "alertmanager",
        )
        wait_for(self._ready, 30, "Alertmanager to be ready", step=0.25, ignore=(OSError,))

    def _ready(self) -> bool:
        self.check_alive()
        return http_get(f"http://{self.address}/-/ready") is not None
