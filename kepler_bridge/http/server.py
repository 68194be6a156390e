"""Runs the agent under gunicorn: one worker (drivers must not be forked), event-loop HTTP, and the
sampler started after the fork."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Mapping

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from kepler_bridge.config import Config
from kepler_bridge.http.host import ConnectionSettings
from kepler_bridge.http.tls import CertificatePair
from kepler_bridge.http.webconfig import WebConfigFile
from kepler_bridge.sampling import carry

if TYPE_CHECKING:  # the worker imports these; the master stays without the sampler and the routes
    from kepler_bridge.anomaly.monitor import AnomalyMonitor
    from kepler_bridge.http.dispatch import Routes
    from kepler_bridge.sampling.sampler import Sampler

THREADS = 4
# mallopt(3) parameter numbers (glibc malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
GRACEFUL_SECONDS = 1
# The worker's youngest collection runs after this many container objects more than freed, not
# CPython's 700: a sample makes and frees some thousands per thousand processes, which set off
# several collections each sample, every one walking the per-process dicts then being built.
GC_YOUNG_THRESHOLD = 10_000


class BindError(Exception):
    """The listen address cannot be bound; the message says why and what to do."""


def bind(config: Config) -> socket.socket:
    """Bind the listening socket in the master: a busy port is one clear error before gunicorn
    starts."""
    host, port = config.listen
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise BindError(
                f"cannot listen on {config.listen_text}: address already in use; stop "
                "the other process or choose another address with --listen"
            ) from None
        raise BindError(
            f"cannot listen on {config.listen_text}: {err.strerror or err}; "
            "choose another address with --listen"
        ) from None
    sock.set_inheritable(True)
    return sock


class AgentApplication(BaseApplication):
    """gunicorn application whose worker builds the sampler and the WSGI app after the fork; the
    worker's `WorkerHost`."""

    def __init__(
        self, config: Config, sock: socket.socket, flags: Mapping[str, object] | None = None
    ) -> None:
        """`flags`: the command line `config` came from, re-read on SIGHUP or when the config file
        changes."""
        self.config = config
        self.flags = flags
        self.sock = sock
        self.sampler: Sampler | None = None
        self.anomaly: AnomalyMonitor | None = None
        self.state_dir = carry.make_dir()
        self._master = os.getpid()
        web = WebConfigFile(config.web_config_file) if config.web_config_file else None
        tls = CertificatePair(config.tls_cert, config.tls_key) if config.tls_cert else None
        self.connections = ConnectionSettings(
            config.http_header_timeout, config.http_write_timeout, tls, web
        )
        super().__init__()

    def load_config(self) -> None:
        settings = {
            "bind": [f"fd://{self.sock.fileno()}"],
            "workers": 1,
            "worker_class": "kepler_bridge.http.worker.EventLoopWorker",
            "threads": THREADS,
            "timeout": 60,
            "graceful_timeout": GRACEFUL_SECONDS,
            "proc_name": "kepler-bridge",
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "info",
            "worker_exit": self._worker_exit,
            "pre_fork": _before_fork,
        }
        # gunicorn >= 24: no shared control socket in $HOME
        if "control_socket_disable" in self.cfg.settings:
            settings["control_socket_disable"] = True
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self) -> Routes:
        """In the worker: start the sampler and build the app that serves its snapshots."""
        from kepler_bridge.anomaly.monitor import AnomalyMonitor, AnomalySettings
        from kepler_bridge.http.app import WebSettings, create_app
        from kepler_bridge.reload import DerivedSettings
        from kepler_bridge.sampling.sampler import Sampler
        from kepler_bridge.store import SnapshotStore

        store = SnapshotStore()
        sampler = Sampler(self.config, store, state_dir=self.state_dir, flags=self.flags)
        self.sampler = sampler
        settle_collector()
        sampler.start()
        self.anomaly = AnomalyMonitor(
            store, DerivedSettings(lambda: sampler.config, AnomalySettings.of)
        )
        self.anomaly.start()
        settings = DerivedSettings(lambda: sampler.config, WebSettings.of)
        return create_app(store, settings, alive=sampler.alive, web=self.connections.web)

    def reload(self) -> None:
        """Re-read the settings before the next sample (SIGHUP in the worker)."""
        if self.sampler is not None:
            self.sampler.reload()

    def run(self) -> None:
        try:
            _Arbiter(self).run()
        except RuntimeError as err:
            print(f"kepler-bridge: {err}", file=sys.stderr)
            sys.exit(1)

    def _worker_exit(self, server, worker) -> None:
        if self.sampler is not None:
            self.sampler.stop(timeout=GRACEFUL_SECONDS / 2)
        if self.anomaly is not None:
            self.anomaly.stop(timeout=GRACEFUL_SECONDS / 4)

    def remove_state(self) -> None:
        """Delete the counter state, in the master only: a worker's exit unwinds through `run()`
        too."""
        if os.getpid() == self._master:
            carry.remove_dir(self.state_dir)


class _Arbiter(Arbiter):
    """gunicorn's master, except that SIGHUP re-reads the settings inside the running worker: a
    new worker would reopen the drivers and reload the eBPF programs, and gunicorn's own reload
    keeps none of our settings."""

    def handle_hup(self) -> None:
        self.log.info("SIGHUP: the worker re-reads its settings")
        self.kill_workers(signal.SIGHUP)


def _glibc() -> ctypes.CDLL | None:
    """glibc, whose malloc is tuned here; None elsewhere (musl), where the tuning is skipped."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _before_fork(server: object, worker: object) -> None:
    """Before each fork: the master's objects leave the garbage collector's generations, so the
    worker's collections do not write into (and copy) the pages the two share; and the free pages
    of the master's malloc heap go back to the kernel instead of being inherited."""
    gc.freeze()
    if libc := _glibc():
        libc.malloc_trim(0)


def settle_collector() -> None:
    """In the worker, its sources started: what start-up made (imports, drivers, eBPF) leaves the
    collector's generations, and the youngest is collected less often (GC_YOUNG_THRESHOLD)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def tune_malloc() -> None:
    """glibc: two arenas and a fixed 128 KiB mmap threshold, set before any thread or fork.

    The worker runs several threads (sampler, HTTP pool, kube, NVML events) and rebuilds
    megabyte-sized buffers every sample (counter state, renders): with per-thread arenas and glibc's
    sliding mmap threshold those freed buffers stay resident as fragmented heap. Measured: 44.6 ->
    40.3 MiB worker RSS under process churn.
    Elsewhere (musl) this does nothing.
    """
    if libc := _glibc():
        libc.mallopt(M_ARENA_MAX, 2)
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def serve(config: Config, flags: Mapping[str, object] | None = None) -> int:
    """Run until SIGTERM/SIGINT; 1 when the address cannot be bound."""
    tune_malloc()
    try:
        sock = bind(config)
    except BindError as err:
        print(f"kepler-bridge: {err}", file=sys.stderr)
        return 1
    app = AgentApplication(config, sock, flags)
    try:
        app.run()
    finally:
        app.remove_state()
    return 0
