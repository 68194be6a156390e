"""podman with its own configuration and storage under a cache folder, and the Debian base image
that stands in for docker.io/library/debian:bookworm-slim there (scripts/debian-base-image.sh),
for one architecture: the image tests build and run the Dockerfile with it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KEPLER_BRIDGE_IMAGE_CACHE", "/var/cache/kepler-bridge-image-test"))
# The tree whose Dockerfile is built: this one, or e.g. a clean `git worktree` when this one holds
# unfinished work.
CONTEXT = Path(os.environ.get("KEPLER_BRIDGE_IMAGE_CONTEXT", ROOT))
BASE = "docker.io/library/debian:bookworm-slim"
# The podman label holding the pid of the pytest run that started the container.
LABEL = "kepler-bridge-test-run"


class Podman:
    """podman with its own configuration, storage and runc state under `cache`; the host's podman
    setup is neither used nor changed (only containers/image's blob-digest cache,
    /var/lib/containers/cache, cannot be moved)."""

    def __init__(self, cache: Path) -> None:
        (cache / "tmp").mkdir(parents=True, exist_ok=True)
        conf, storage, runc = (
            cache / "containers.conf",
            cache / "storage.conf",
            cache / "runc-wrapper",
        )
        # runc keeps its state under the cache too (else in /run/runc), for podman,
        # its builds and conmon's cleanup.
        runc.write_text(
            "#!/bin/sh\n"
            f'exec {shutil.which("runc") or "runc"} --root "{cache / "runc-state"}" "$@"\n'
        )
        runc.chmod(0o755)
        conf.write_text(
            "[containers]\n"
            "# Inherit this process's limits: podman's own (1048576 files) need "
            "CAP_SYS_RESOURCE (root may lack it).\n"
            "default_ulimits = []\n"
            "[engine]\n"
            "# runc, not crun: bookworm's crun 1.8 refuses hybrid (v1 + v2) cgroup layouts. "
            "No systemd, no journald.\n"
            'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'tmp_dir = "{cache / "tmp"}"\n'
            f'[engine.runtimes]\nrunc = ["{runc}"]\n'
        )
        storage.write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{cache / "storage"}"\n'
            f'runroot = "{cache / "run"}"\n'
        )
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(conf),
            "CONTAINERS_STORAGE_CONF": str(storage),
            "TMPDIR": str(cache / "tmp"),
        }
        # Docker format keeps HEALTHCHECK; RUN steps use the host's network
        # (podman has no other set up here).
        self.build_options = ["--format", "docker", "--network", "host", "--pull=never"]

    def __call__(
        self, *args: str, timeout: float = 60, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """podman `args`, with `env` added to its environment (e.g. $HOME: containers/image reads
        registries.d under it)."""
        result = subprocess.run(
            ["podman", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                f"{result.stderr[-4000:]}",
                pytrace=False,
            )
        return result


def podman_with_base(cache: Path, arch: str | None = None) -> Podman:
    """podman under `cache` with the base image of `arch` (a Debian architecture; None: this
    machine's) imported as BASE, built once a week into cache/base; containers of interrupted
    runs are removed."""
    missing = [tool for tool in ("podman", "runc", "debootstrap") if not shutil.which(tool)]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not installed: run make deps "
            "(bash scripts/apt-install.sh podman runc debootstrap)",
            pytrace=False,
        )
    tool = Podman(cache)
    _remove_leftovers(tool)
    script = ["bash", str(ROOT / "scripts" / "debian-base-image.sh"), str(cache / "base")]
    base = subprocess.run(
        script + ([arch] if arch else []), capture_output=True, text=True, timeout=900
    )
    if base.returncode != 0:
        pytest.fail(f"building the base image failed:\n{base.stderr[-4000:]}", pytrace=False)
    tarball = Path(base.stdout.strip())
    imported = cache / "storage-base"  # which tarball the stored base image came from
    present = tool("image", "exists", BASE, check=False).returncode == 0
    if not (present and imported.exists() and imported.read_text() == tarball.name):
        tool("import", *(["--arch", arch] if arch else []), str(tarball), BASE, timeout=300)
        imported.write_text(tarball.name)
        tool("image", "prune", "--force", timeout=300)  # layers built on the previous base
    return tool


def _remove_leftovers(tool: Podman) -> None:
    """Remove the containers of test runs that are gone (interrupted);
    those of a run still going stay."""
    columns = f'{{{{.Names}}}} {{{{index .Labels "{LABEL}"}}}}'
    listed = tool("ps", "--all", "--filter", f"label={LABEL}", "--format", columns)
    for line in listed.stdout.splitlines():
        name, pid = line.split()
        if not Path(f"/proc/{pid}").exists():
            tool("rm", "--force", "--time", "0", name, check=False)
