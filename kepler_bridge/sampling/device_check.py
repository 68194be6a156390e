"""doctor's line on device assignments: whether pod-resources answered here, or the devices come
from the containers' environment, and how many containers that read."""

from __future__ import annotations

import errno
import os

from kepler_bridge.config import Config
from kepler_bridge.kube.metadata import KubeMetadata
from kepler_bridge.sampling.environment import EnvironmentTally
from kepler_bridge.sampling.sampler import Sampler
from kepler_bridge.store import SnapshotStore

# Each sample reads at most environment.MAX_READS new containers: enough samples for 80.
MAX_SAMPLES = 10
_DENIED = (os.strerror(errno.EACCES), os.strerror(errno.EPERM))


def check_devices(config: Config) -> tuple[str, str]:
    """doctor's mark ("ok ", "no " or "-- ") and line: where this node's device assignments come
    from. Refreshes the Kubernetes view once; reading the environment, samples until it learns no
    more."""
    metadata = KubeMetadata(config)
    metadata.refresh()
    kube = metadata.view()
    socket = _pod_resources(config, metadata.errors.get("devices", ""))
    if not kube.learn_from_environment:
        return "ok ", f"pod-resources at {config.pod_resources_socket} answered"
    if not config.device_environment:
        return "-- ", f"{socket}; --device-environment off: no device is given to a container"
    if not kube.containers:
        problem = metadata.errors.get("pods") or f"kube-source {config.kube_source}"
        return "-- ", f"{socket}; no pod list ({problem}): no container's environment is read"
    sampler = Sampler(config, SnapshotStore())
    sampler.kube = metadata
    try:
        tally = _settled(sampler)
    finally:
        sampler.stop()
    return ("no " if tally.failed else "ok "), f"{socket}; {_environment(tally)}"


def _pod_resources(config: Config, error: str) -> str:
    if not config.pod_resources_socket:
        return "no pod-resources socket set"
    if error:
        return f"pod-resources at {config.pod_resources_socket}: {error}"
    return f"no pod-resources socket at {config.pod_resources_socket}"


def _settled(sampler: Sampler) -> EnvironmentTally:
    """The tally once a sample learns nothing new (or after MAX_SAMPLES samples)."""
    tally = None
    for _ in range(MAX_SAMPLES):
        sampler.sample()
        now = sampler.environment.tally()
        if now == tally:
            break
        tally = now
    return sampler.environment.tally()


def _environment(tally: EnvironmentTally) -> str:
    line = (
        f"devices from the environment: {tally.read} containers read, "
        f"{tally.holding} give devices, {tally.failed} reads failed"
    )
    if tally.failed and tally.last_error in _DENIED:
        return (
            f"{line} ({tally.last_error}: give the agent CAP_SYS_PTRACE to read environ, and "
            "CAP_DAC_READ_SEARCH for containers of another uid)"
        )
    return f"{line} (last: {tally.last_error})" if tally.failed else line
