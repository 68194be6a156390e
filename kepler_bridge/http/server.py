"""Starts the agent: the listen socket and the state directory in `kepler-bridge serve`, which
then becomes the master (supervisor.py); and the worker process (`python -m` this module), which
runs gunicorn's worker with event-loop HTTP, the sampler and the routes."""

from __future__ import annotations

import argparse
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Mapping

from gunicorn import sock as gunicorn_sock
from gunicorn.app.base import BaseApplication

from kepler_bridge.config import Config
from kepler_bridge.http import held_settings, kept_files, preflight, supervisor
from kepler_bridge.http.host import ConnectionSettings
from kepler_bridge.http.kept_files import KeptFiles
from kepler_bridge.http.tls import CertificatePair
from kepler_bridge.http.webconfig import WebConfigFile
from kepler_bridge.http.webconfig import read as read_web_config
from kepler_bridge.http.worker import EventLoopWorker
from kepler_bridge.log_format import log_to_stderr
from kepler_bridge.sampling import carry

if TYPE_CHECKING:  # imported by load(), in the worker: `serve` has neither sampler nor route
    from kepler_bridge.anomaly.monitor import AnomalyMonitor
    from kepler_bridge.http.dispatch import Routes
    from kepler_bridge.sampling.sampler import Sampler

log = logging.getLogger(__name__)

THREADS = 4
# mallopt(3) parameter numbers (glibc malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
PR_SET_PDEATHSIG = 1  # prctl(2) option, linux/prctl.h
GRACEFUL_SECONDS = supervisor.GRACEFUL_SECONDS
# The worker's youngest collection runs after this many container objects more than freed, not
# CPython's 700: a sample makes and frees some thousands per thousand processes, which set off
# several collections each sample, every one walking the per-process dicts then being built.
GC_YOUNG_THRESHOLD = 10_000


class BindError(Exception):
    """The listen address cannot be bound; the message says why and what to do."""


def bind(config: Config) -> socket.socket:
    """Bind the listening socket before the master starts: a busy port is one clear error. No
    host is every address: IPv6 and IPv4 on one socket, IPv4 alone where the kernel has no IPv6."""
    try:
        sock = _bound(*config.listen)
    except OSError as err:
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


def _bound(host: str, port: int) -> socket.socket:
    if host:
        return _listening(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port)
    try:
        return _listening(socket.AF_INET6, "::", port)
    except OSError as err:
        if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
    return _listening(socket.AF_INET, "0.0.0.0", port)


def _listening(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A socket listening on (host, port); on IPv6's "::", IPv4 clients too (as ::ffff:a.b.c.d)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class AgentApplication(BaseApplication):
    """gunicorn application of the worker process: it builds the sampler and the WSGI app; the
    worker's `WorkerHost`."""

    def __init__(
        self,
        config: Config,
        sock: socket.socket,
        flags: Mapping[str, object] | None = None,
        state_dir: str = "",
        kept: KeptFiles | None = None,
    ) -> None:
        """`flags`: the command line `config` came from, re-read on SIGHUP or when the config file
        changes; `state_dir`: the master's counter-state directory; `kept`: the TLS and web-config
        files as the agent started with them."""
        self.config = config
        self.flags = flags
        self.sock = sock
        self.sampler: Sampler | None = None
        self.anomaly: AnomalyMonitor | None = None
        self.state_dir = state_dir
        self.kept = kept
        self.held: int | None = None  # the master's settings file, told each reload taken
        web = WebConfigFile(config.web_config_file, kept) if config.web_config_file else None
        tls = CertificatePair(config.tls_cert, config.tls_key, kept) if config.tls_cert else None
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
            "timeout": supervisor.TIMEOUT_SECONDS,
            "graceful_timeout": GRACEFUL_SECONDS,
            "proc_name": supervisor.NAME,
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "info",
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
        sampler = Sampler(
            self.config,
            store,
            state_dir=self.state_dir,
            flags=self.flags,
            check=preflight.check,
            remember=self.remember,
        )
        self.sampler = sampler
        settle_collector()
        sampler.start()
        self.anomaly = AnomalyMonitor(
            store, DerivedSettings(lambda: sampler.config, AnomalySettings.of)
        )
        self.anomaly.start()
        settings = DerivedSettings(lambda: sampler.config, WebSettings.of)
        return create_app(store, settings, alive=sampler.alive, web=self.connections.web)

    def remember(self, config: Config) -> None:
        """Hold `config`, the settings a reload put in force, for the master's next worker."""
        if self.held is None:
            return
        files = self.kept.files if self.kept is not None else {}
        try:
            held_settings.write(self.held, (config, dict(self.flags or {}), files))
        except OSError as err:
            log.warning("a worker started after this one will run older settings: %s", err)

    def reload(self) -> None:
        """Re-read the settings and sample now (SIGHUP in the worker)."""
        if self.sampler is not None:
            self.sampler.reload()

    def stop(self) -> None:
        """The worker exits: stop the sampler and the detectors within the master's grace."""
        if self.sampler is not None:
            self.sampler.stop(timeout=GRACEFUL_SECONDS / 2)
        if self.anomaly is not None:
            self.anomaly.stop(timeout=GRACEFUL_SECONDS / 4)


class Heartbeat:
    """The master's heartbeat file, handed to the worker in place of gunicorn's WorkerTmp (the two
    methods gunicorn's worker calls): touched with the monotonic clock the master compares."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def notify(self) -> None:
        now = time.monotonic()
        os.utime(self.fd, (now, now))

    def fileno(self) -> int:
        return self.fd


def _glibc() -> ctypes.CDLL | None:
    """glibc, whose malloc is tuned here; None elsewhere (musl), where the tuning is skipped."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def settle_collector() -> None:
    """In the worker, its sources started: what start-up made (imports, drivers, eBPF) leaves the
    collector's generations, and the youngest is collected less often (GC_YOUNG_THRESHOLD)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def tune_malloc() -> None:
    """glibc: two arenas and a fixed 128 KiB mmap threshold, set before any thread or fork.

    The worker runs several threads (sampler, HTTP pool, kube, anomaly) and rebuilds
    megabyte-sized buffers every sample (counter state, renders): with per-thread arenas and glibc's
    sliding mmap threshold those freed buffers stay resident as fragmented heap. Measured: 44.6 ->
    40.3 MiB worker RSS under process churn.
    Elsewhere (musl) this does nothing.
    """
    if libc := _glibc():
        libc.mallopt(M_ARENA_MAX, 2)
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def end_with_master() -> None:
    """Have the kernel send the worker SIGTERM, as the master stops it, when the master dies
    (PR_SET_PDEATHSIG); a master gone already is seen by the worker's first beat."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))


def serve(config: Config, flags: Mapping[str, object] | None = None) -> int:
    """Bind, make the state directory and become the master (supervisor.py, the same pid), which
    runs the worker until SIGTERM/SIGINT; 1 when the address cannot be bound."""
    try:
        sock = bind(config)
    except BindError as err:
        print(f"kepler-bridge: {err}", file=sys.stderr)
        return 1
    state_dir = carry.make_dir()
    # The settings as validated here, for every worker the master starts: a memory file that
    # only this process tree holds (the worker reads it back, from its own parent).
    settings = held_settings.create((config, dict(flags or {}), _kept(config)))
    os.set_inheritable(settings, True)
    sys.stdout.flush()
    sys.stderr.flush()
    args = ["--listen-fd", str(sock.fileno()), "--settings-fd", str(settings)]
    try:
        os.execv(sys.executable, [sys.executable, "-S", supervisor.__file__, state_dir, *args])
    except OSError as err:
        carry.remove_dir(state_dir)
        print(f"kepler-bridge: cannot start the master ({sys.executable}): {err}", file=sys.stderr)
    return 1


def _kept(config: Config) -> dict[str, bytes]:
    """The TLS pair and the web config with the files it names, as validated at the start."""
    paths = [config.tls_cert, config.tls_key] if config.tls_cert else []
    if config.web_config_file:
        paths += read_web_config(config.web_config_file).files
    return kept_files.capture(paths)


def worker_main(argv: list[str]) -> int:
    """The worker process: the settings the master holds, the listen socket, gunicorn's worker."""
    parser = argparse.ArgumentParser(prog=f"{supervisor.NAME} worker")
    for name in ("--listen-fd", "--settings-fd", "--heartbeat-fd"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--state-dir", default="")
    options = parser.parse_args(argv)
    supervisor.name_process()
    end_with_master()
    tune_malloc()
    log_to_stderr()
    try:
        app, worker = _worker(options)
    except Exception:
        log.exception("the worker cannot start")
        return supervisor.BOOT_FAILED
    worker.log.info("Booting worker with pid: %s", os.getpid())
    try:
        worker.init_process()
        return 0
    except Exception:
        worker.log.exception("Exception in worker process")
        return 1 if worker.booted else supervisor.BOOT_FAILED
    finally:
        worker.log.info("Worker exiting (pid: %s)", os.getpid())
        app.stop()


def _worker(options: argparse.Namespace) -> tuple[AgentApplication, EventLoopWorker]:
    """The application and gunicorn's worker, from what the master hands over."""
    config, flags, kept = held_settings.read(options.settings_fd)
    sock = socket.socket(fileno=options.listen_fd)
    app = AgentApplication(config, sock, flags, options.state_dir, KeptFiles(kept))
    app.held = options.settings_fd
    cfg = app.cfg
    logger = cfg.logger_class(cfg)
    listeners = gunicorn_sock.create_sockets(cfg, logger)
    worker = EventLoopWorker(1, os.getppid(), listeners, app, cfg.timeout / 2.0, cfg, logger)
    worker.tmp.close()
    worker.tmp = Heartbeat(options.heartbeat_fd)
    return app, worker


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
