"""Starts the real agent (`kepler-bridge serve`, gunicorn inside) on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from scaffold import free_port, source_states, values, wait_for

KEPLER_BRIDGE = str(Path(sys.executable).with_name("kepler-bridge"))


class Agent:
    """A running `kepler-bridge serve`; use as a context manager."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        ready: bool = True,
        timeout: float = 20.0,
        ca: str = "",
        client_cert: tuple[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        """`ca`: the agent serves HTTPS with a certificate this CA file verifies.

        `client_cert`: (cert, key) to present. `cwd`: the working directory it starts in."""
        self.port = free_port()
        self.url = f"{'https' if ca else 'http'}://127.0.0.1:{self.port}"
        self.verify: str | bool = ca or True
        self.client_cert = client_cert
        self.args = [
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--node-name",
            "test-node",
            *args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.ready = ready
        self.timeout = timeout
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> "Agent":
        # A file, not a pipe: an unread pipe would fill up and block the agent's logging.
        self.process = subprocess.Popen(
            [KEPLER_BRIDGE, *self.args],
            env=self.env,
            cwd=self.cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        path = "/readyz" if self.ready else "/healthz"
        try:
            wait_for(lambda: self._answers(path), self.timeout, f"agent {path}", log=self.output)
        except AssertionError:
            self.stop()
            raise
        return self

    def _answers(self, path: str) -> bool:
        """Whether `path` answers 200 now; raises when the agent has exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"agent exited {self.process.returncode}: {self.output()}")
        try:
            response = requests.get(
                self.url + path, timeout=1, verify=self.verify, cert=self.client_cert
            )
        except (
            requests.RequestException
        ):  # not listening yet, or too busy to answer within the second
            return False
        return response.status_code == 200

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(
            self.url + path, timeout=5, verify=self.verify, cert=self.client_cert, **kwargs
        )

    def worker_pids(self) -> list[int]:
        """The gunicorn workers the agent's master runs now."""
        master = self.process.pid
        return [
            int(pid) for pid in Path(f"/proc/{master}/task/{master}/children").read_text().split()
        ]

    def metrics(self) -> str:
        response = self.get("/metrics")
        response.raise_for_status()
        return response.text

    def samples(self, name: str) -> dict[str, float]:
        """Values of one metric from /metrics, keyed by the `gpu` label (or '' when absent)."""
        return values(self.metrics(), name, "gpu")

    def source_states(self) -> dict[str, str]:
        """Each source's state (up, down, standby, absent) from kepler_bridge_source_state."""
        return source_states(self.metrics())

    def wait_for(self, check, timeout: float = 10.0, what: str = "condition"):
        """scaffold.wait_for with the agent's log in the failure."""
        return wait_for(check, timeout, what, log=self.output)

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
