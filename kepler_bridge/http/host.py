"""What the event-loop worker needs of the gunicorn application that runs it.

The worker reaches the agent only through `WorkerHost`; `server.AgentApplication` provides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kepler_bridge.http.tls import CertificatePair
from kepler_bridge.http.webconfig import WebConfigFile


@dataclass(frozen=True)
class ConnectionSettings:
    """How the worker treats connections: slow-client timeouts, and TLS from `web`
    (--web.config.file, which also names the allowed client certificates) or from `tls`
    (--tls-cert/--tls-key)."""

    header_timeout: float
    write_timeout: float
    tls: CertificatePair | None = None
    web: WebConfigFile | None = None


class WorkerHost(Protocol):
    """What the worker needs of the gunicorn application that runs it, besides `wsgi()`."""

    connections: ConnectionSettings

    def reload(self) -> None:
        """Re-read the agent's settings and sample now (the master forwards SIGHUP)."""
