"""The images for linux/arm64, built from the same Dockerfile on a debootstrap arm64 base
(scripts/debian-base-image.sh CACHE arm64) on this amd64 machine under Debian's qemu-user-static:
every binary in them is aarch64; the `slim` one runs under emulation and serves its endpoints
through a published port on loopback, the default one (bcc) is built and its bcc imported.

podman's storage for arm64 is its own (CACHE/arm64: the base image is imported under the same
name as the amd64 one), kept between runs like tests/test_image.py's: a second run reuses the base
and the layers.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pytest
import requests

from kepler_bridge import __version__
from podman_store import CACHE, CONTEXT, LABEL, Podman, podman_with_base
from scaffold import free_port, require, samples, wait_for

pytestmark = pytest.mark.e2e

IMAGE = "localhost/kepler-bridge:test-slim-arm64"
FULL_IMAGE = "localhost/kepler-bridge:test-arm64"
NODE = "arm64-test-node"
# The kernel's binfmt_misc entry that qemu-user-static registers for aarch64 ELF binaries.
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
EM_AARCH64 = 183  # e_machine of an aarch64 ELF file
# Start-up under emulation: Python, gunicorn and the first sample run about ten times slower.
START_SECONDS = 240
# The image's platform (podman warns of one not the host's), and no HEALTHCHECK timer (no systemd).
RUN_OPTIONS = ("--platform", "linux/arm64", "--no-healthcheck")


@pytest.fixture(scope="module")
def podman() -> Podman:
    require(os.geteuid() == 0, "not root: podman builds and runs the image only as root here")
    if not shutil.which("qemu-aarch64-static"):
        pytest.fail(
            "qemu-user-static not installed: run make deps "
            "(bash scripts/apt-install.sh qemu-user-static binfmt-support)",
            pytrace=False,
        )
    registered = BINFMT.exists() and BINFMT.read_text().startswith("enabled")
    require(
        registered,
        f"no enabled {BINFMT}: update-binfmts --enable qemu-aarch64 (binfmt_misc mounted "
        "at /proc/sys/fs/binfmt_misc: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc)",
    )
    return podman_with_base(CACHE / "arm64", "arm64")


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    podman(
        "build",
        *podman.build_options,
        "--platform",
        "linux/arm64",
        "--target",
        "slim",
        "--tag",
        IMAGE,
        str(CONTEXT),
        timeout=1800,
    )
    return IMAGE


class Agent(NamedTuple):
    """The agent container: its published address and its log."""

    url: str
    logs: Callable[[], str]


@pytest.fixture(scope="module")
def agent(podman: Podman, image: str) -> Iterator[Agent]:
    """The image's own entrypoint with two simulated accelerators, on the default bridge network
    with its port published on 127.0.0.1."""
    port, name = free_port(), f"kepler-bridge-test-arm64-{os.getpid()}"
    podman(
        "run",
        "--detach",
        "--name",
        name,
        "--label",
        f"{LABEL}={os.getpid()}",
        *RUN_OPTIONS,
        "--publish",
        f"127.0.0.1:{port}:30060",
        "--env",
        f"KUBE_NODE_NAME={NODE}",
        image,
        "serve",
        "--simulate",
        "2",
    )
    try:
        yield Agent(f"http://127.0.0.1:{port}", lambda: _logs(podman, name))
    finally:
        podman("rm", "--force", "--time", "2", name, check=False)


def _logs(podman: Podman, name: str) -> str:
    result = podman("logs", name, check=False)
    return result.stdout + result.stderr


def _in_image(root: Path, path: str) -> Path:
    """`path` of the image mounted at `root`, its symbolic links followed inside the image."""
    found = root / path.lstrip("/")
    while found.is_symlink():
        link = os.readlink(found)
        found = root / link.lstrip("/") if link.startswith("/") else found.parent / link
    return found


def _elf_machine(path: Path) -> int:
    """e_machine of a little-endian ELF file."""
    with path.open("rb") as file:
        header = file.read(20)
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return struct.unpack_from("<H", header, 18)[0]


def _machines(podman: Podman, image: str, paths: list[str], globs: list[str]) -> dict[str, int]:
    """e_machine of `paths` and of the files matching `globs` (neither links) in the image,
    read from outside (podman image mount): path -> machine."""
    root = Path(podman("image", "mount", image).stdout.strip())
    try:
        matched = [
            path
            for pattern in globs
            for path in root.glob(pattern.lstrip("/"))
            if path.is_file() and not path.is_symlink()
        ]
        assert len(matched) >= len(globs), f"{globs} match too little in {image}: {matched}"
        binaries = [_in_image(root, path) for path in paths] + matched
        return {str(path.relative_to(root)): _elf_machine(path) for path in binaries}
    finally:
        podman("image", "unmount", image, check=False)


def _uname(podman: Podman, image: str) -> str:
    """`uname -m` inside the image."""
    command = ("run", "--rm", *RUN_OPTIONS, "--network", "none", "--entrypoint", "uname")
    return podman(*command, image, "-m").stdout.strip()


def test_arm64_image_is_aarch64_through_and_through(podman: Podman, image: str) -> None:
    inspect = podman("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", image)
    assert inspect.stdout.strip() == "linux/arm64"
    # The interpreter, a shell, and the compiled modules of the wheels pip chose (grpcio, PyYAML,
    # protobuf, bcrypt): none of them is the build machine's.
    machines = _machines(
        podman, image, ["/usr/bin/python3", "/bin/sh"], ["/opt/kepler-bridge/**/*.so"]
    )
    assert set(machines.values()) == {EM_AARCH64}, machines
    assert _uname(podman, image) == "aarch64"


def test_arm64_image_serves_from_outside(agent: Agent) -> None:
    _answer(agent, "/healthz", START_SECONDS)
    assert _answer(agent, "/readyz", 60).json()["ready"] is True
    metrics = _answer(agent, "/metrics", 30)
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples(metrics.text)}
    assert found[("kepler_bridge_build_info", (("node", NODE), ("version", __version__)))] == 1
    up = {dict(labels)["gpu"]: value for (name, labels), value in found.items() if name == "gpu_up"}
    assert up == {"0": 1.0, "1": 1.0}, up
    collect = _answer(agent, "/v1/collect", 30).json()
    assert list(collect) == [NODE] and collect[NODE]["deviceNum"] == 2
    assert len(collect[NODE]["devices"]) == 2


def _answer(agent: Agent, path: str, seconds: float) -> requests.Response:
    """The first 200 answer of `path` within `seconds`."""
    return wait_for(
        lambda: (
            (answer := requests.get(agent.url + path, timeout=10)).status_code == 200 and answer
        ),
        seconds,
        f"{path} of the arm64 image answering 200",
        step=2,
        ignore=(requests.RequestException,),
        log=agent.logs,
    )


@pytest.fixture(scope="module")
def full_image(podman: Podman, image: str) -> str:
    """The default target, with bcc: the slim image's layers plus Debian's python3-bpfcc."""
    podman(
        "build",
        *podman.build_options,
        "--platform",
        "linux/arm64",
        "--target",
        "full",
        "--tag",
        FULL_IMAGE,
        str(CONTEXT),
        timeout=1800,
    )
    return FULL_IMAGE


def test_arm64_full_image_has_bcc_for_aarch64(podman: Podman, full_image: str) -> None:
    """Built only: eBPF needs the node's kernel, which qemu's user-mode emulation does not give
    (tests/test_image.py runs the amd64 one)."""
    machines = _machines(podman, full_image, ["/usr/bin/python3"], ["/usr/lib/*/libbcc.so.*"])
    assert set(machines.values()) == {EM_AARCH64}, machines
    command = ("run", "--rm", *RUN_OPTIONS, "--network", "none", "--entrypoint", "python3")
    imported = podman(*command, full_image, "-c", "import bcc, platform; print(platform.machine())")
    assert imported.stdout.strip() == "aarch64"
