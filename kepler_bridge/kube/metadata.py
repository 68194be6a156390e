"""Keeps the Kubernetes view fresh in a background thread; the sampler only ever reads the newest
view."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Iterable, Mapping

from kepler_bridge.config import Config
from kepler_bridge.kube.client import Endpoint, KubeError, endpoints, fetch_pods
from kepler_bridge.kube.view import Assignment, KubeView, device_owners
from kepler_bridge.model import PodRef

log = logging.getLogger(__name__)

REFRESH_SECONDS = 30.0
MIN_REFRESH_SECONDS = 2.0
MAX_NOTICED = 10000
# How often an unknown container asks for an early refresh: at first sight, then again after 2, 4,
# 8 and 16 times the least refresh period. A container's first process runs before the kubelet,
# and the API server after it, lists its id: one early refresh mostly comes too soon.
NOTICE_ASKS = 5


class KubeMetadata:
    """Pod lists and device assignments, refreshed every `period` seconds and soon after an unknown
    container shows up; when an endpoint is down the last good answer stays."""

    def __init__(
        self,
        config: Config,
        environ: Mapping[str, str] | None = None,
        period: float = REFRESH_SECONDS,
        min_period: float = MIN_REFRESH_SECONDS,
    ) -> None:
        self.config = config
        self.endpoints = endpoints(config, os.environ if environ is None else environ)
        self.socket = config.pod_resources_socket
        self.period, self.min_period = period, min_period
        self.errors: dict[str, str] = {}
        self._view = KubeView()
        self._containers: dict[str, PodRef] = {}
        self._finished: frozenset[tuple[str, str]] = frozenset()  # pods that ended for good
        self._assignments: tuple[Assignment, ...] = ()
        self._preferred: Endpoint | None = None
        self._noticed: dict[str, tuple[int, float]] = {}  # id -> (asks so far, when to ask again)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def view(self) -> KubeView:
        """The newest view: one reference read, never blocks."""
        return self._view

    def start(self) -> None:
        """Start refreshing in the background (nothing to do when neither pods nor devices are
        asked for)."""
        if self._thread is None and (self.endpoints or self.socket):
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="kepler-bridge-kube", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def notice(self, container_ids: Iterable[str], now: float | None = None) -> None:
        """Ask for an early refresh when containers the view does not name show up: each id at
        first sight and NOTICE_ASKS - 1 times more, each wait twice the last."""
        now = time.monotonic() if now is None else now
        noticed, asked = self._noticed, False
        for container in set(container_ids) - self._view.containers.keys():
            asks, due = noticed.get(container, (0, now))
            if asks < NOTICE_ASKS and now >= due:
                noticed[container] = (asks + 1, now + self.min_period * 2 ** (asks + 1))
                asked = True
        if asked:
            if len(noticed) > MAX_NOTICED:
                noticed.clear()
            self._wake.set()

    def refresh(self) -> None:
        """Read the pod list and the device assignments once, keeping the last good answer of
        each."""
        if self.endpoints:
            self._refresh_pods()
        # No socket (EdgeCore serves none) or no answer: the sampler learns devices from the
        # containers' environment, and the last assignments pod-resources gave still win.
        answered = bool(self.socket) and os.path.exists(self.socket) and self._refresh_devices()
        # pod-resources may still list the devices of pods that finished (kubernetes#119423),
        # which a new pod holds now: a second holder would take the device's energy from it.
        finished = self._finished
        held = [a for a in self._assignments if (a.owner.namespace, a.owner.pod) not in finished]
        self._view = KubeView(
            self._containers, device_owners(held), learn_from_environment=not answered
        )

    def _refresh_pods(self) -> None:
        problems = []
        for endpoint in sorted(self.endpoints, key=lambda endpoint: endpoint != self._preferred):
            try:
                self._containers, self._finished = fetch_pods(endpoint, self.config)
            except KubeError as err:
                problems.append(str(err))
                continue
            if endpoint != self._preferred:
                log.info("pod metadata from the %s at %s", endpoint.name, endpoint.url)
            self._preferred = endpoint
            self._report("pods", "")
            return
        # With auto and nothing ever answering, this node is most likely not in Kubernetes at all.
        quiet = self.config.kube_source == "auto" and self._preferred is None
        self._report(
            "pods",
            "; ".join(problems) + (" (keeping the last pod list)" if self._containers else ""),
            logging.INFO if quiet else logging.WARNING,
        )

    def _refresh_devices(self) -> bool:
        """Ask pod-resources; whether it answered."""
        # Imported here: grpc loads only where a pod-resources socket exists.
        from kepler_bridge.kube.pod_resources import list_assignments

        try:
            self._assignments = list_assignments(
                self.socket, self.config.kube_timeout, self.config.kube_max_reply_bytes
            )
        except KubeError as err:
            self._report(
                "devices",
                f"{err}" + (" (keeping the last assignments)" if self._assignments else ""),
            )
            return False
        self._report("devices", "")
        return True

    def _report(self, part: str, error: str, level: int = logging.WARNING) -> None:
        if error != self.errors.get(part, ""):
            if error:
                log.log(level, "Kubernetes %s: %s", part, error)
            else:
                log.info("Kubernetes %s readable again", part)
        self.errors[part] = error

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.refresh()
            except Exception:  # the thread must outlive any surprise in a reply
                log.exception("refreshing Kubernetes metadata")
            if self._stop.wait(self.min_period):
                return
            self._wake.wait(max(0.0, self.period - self.min_period))
