"""Starts the real agent (`kepler-bridge serve`, gunicorn inside) on a free loopback port for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

KEPLER_BRIDGE = str(Path(sys.executable).with_name("kepler-bridge"))


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Agent:
    """A running `kepler-bridge serve`; use as a context manager."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ready: bool = True,
                 timeout: float = 20.0, ca: str = "", client_cert: tuple[str, str] | None = None) -> None:
        """`ca`: the agent serves HTTPS with a certificate this CA file verifies; `client_cert`: (cert, key) to present."""
        self.port = free_port()
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.verify: str | bool = ca or True
        self.client_cert = client_cert
        self.args = ["serve", "--listen", f"127.0.0.1:{self.port}", "--node-name", "test-node", *args]
        self.env = {**os.environ, **(env or {})}
        self.ready = ready
        self.timeout = timeout
        self.process: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> "Agent":
        # A file, not a pipe: an unread pipe would fill up and block the agent's logging.
        self.process = subprocess.Popen([KEPLER_BRIDGE, *self.args], env=self.env, stdout=self.log,
                                        stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.timeout
        path = "/readyz" if self.ready else "/healthz"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"agent exited {self.process.returncode}: {self.output()}")
            try:
                if requests.get(self.url + path, timeout=1, verify=self.verify,
                                cert=self.client_cert).status_code == 200:
                    return self
            except requests.RequestException:  # not listening yet, or too busy to answer within the second
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"agent not {path} within {self.timeout}s: {self.output()}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=5, verify=self.verify, cert=self.client_cert, **kwargs)

    def worker_pids(self) -> list[int]:
        """The gunicorn workers the agent's master runs now."""
        master = self.process.pid
        return [int(pid) for pid in Path(f"/proc/{master}/task/{master}/children").read_text().split()]

    def metrics(self) -> str:
        response = self.get("/metrics")
        response.raise_for_status()
        return response.text

    def samples(self, name: str) -> dict[str, float]:
        """Values of one metric from /metrics, keyed by the `gpu` label (or '' when absent)."""
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name == name:
                    found[sample.labels.get("gpu", "")] = sample.value
        return found

    def source_states(self) -> dict[str, str]:
        """Each source's state (up, down, standby, absent) from kepler_bridge_source_state in /metrics."""
        return {sample.labels["source"]: sample.labels["state"]
                for family in text_string_to_metric_families(self.metrics()) for sample in family.samples
                if sample.name == "kepler_bridge_source_state" and sample.value == 1}

    def wait_for(self, check, timeout: float = 10.0, what: str = "condition"):
        """Poll check() until it returns something truthy; fail with the agent's log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.1)
        raise AssertionError(f"{what} not met within {timeout}s; agent log:\n{self.output()[-3000:]}")

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM the agent; return how long it took to exit."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return time.monotonic() - started

    def output(self) -> str:
        """Everything the agent printed so far."""
        self.log.seek(0)
        return self.log.read()
