"""Find the kernel headers bcc compiles against, the way bcc does, or say exactly what is missing.

bcc's order: ``BCC_KERNEL_SOURCE``; ``/lib/modules/$(uname -r)/{build,source}``;
``/sys/kernel/kheaders.tar.xz``. A pod may instead mount the host's root
(``--procfs /host/proc`` implies ``/host``): its ``/lib/modules`` links are
then resolved inside that root and handed to bcc as ``BCC_KERNEL_SOURCE``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Mapping

KCONFIG = "include/linux/kconfig.h"
AUTOCONF = "include/generated/autoconf.h"
KHEADERS = "/sys/kernel/kheaders.tar.xz"
_ARCH = {
    "x86_64": "x86",
    "aarch64": "arm64",
    "ppc64le": "powerpc",
    "s390x": "s390",
    "riscv64": "riscv",
}


class HeadersMissing(Exception):
    """No usable header tree; the message lists what was checked and how to fix it."""


@dataclass(frozen=True)
class HeaderTree:
    """A header tree bcc can compile with; environ/cflags tell the loader how to point bcc at it."""

    source: str
    build: str
    origin: str
    environ: Mapping[str, str] = field(default_factory=dict)
    cflags: tuple[str, ...] = ()


def host_root(procfs: str) -> str:
    """The host's root mount implied by --procfs (``/host/proc`` -> ``/host``), or '' for
    ``/proc``."""
    path = os.path.normpath(procfs)
    if path == "/proc" or os.path.basename(path) != "proc":
        return ""
    return os.path.dirname(path)


def find(
    release: str | None = None,
    environ: Mapping[str, str] | None = None,
    procfs: str = "/proc",
    modules_dir: str = "/lib/modules",
    kheaders: str = KHEADERS,
) -> HeaderTree:
    """The header tree for the running kernel, or HeadersMissing naming each place checked."""
    release = release or platform.release()
    environ = os.environ if environ is None else environ
    explicit = environ.get("BCC_KERNEL_SOURCE")
    if explicit:
        return _explicit_tree(explicit, release, modules_dir)
    checked: list[str] = []

    tree, problem = _modules_tree(f"{modules_dir}/{release}", "")
    if tree:
        return tree
    checked.append(problem)

    root = host_root(procfs)
    if root:
        tree, problem = _modules_tree(f"{root}{modules_dir}/{release}", root)
        if tree:
            return tree
        checked.append(problem)

    if os.path.isfile(kheaders):
        return HeaderTree(kheaders, kheaders, f"{kheaders} (bcc unpacks it)")
    checked.append(
        f"{kheaders} does not exist (kernel without CONFIG_IKHEADERS, or run: modprobe kheaders)"
    )
    raise _missing(release, checked)


def _explicit_tree(explicit: str, release: str, modules_dir: str) -> HeaderTree:
    """The tree BCC_KERNEL_SOURCE names; bcc itself never looks further once it is set."""
    problem = _single_tree_problem(explicit)
    if problem is None:
        return HeaderTree(explicit, explicit, f"BCC_KERNEL_SOURCE={explicit}")
    raise HeadersMissing(
        f"BCC_KERNEL_SOURCE={explicit}: {problem}; point it at a configured kernel "
        f"header tree for {release}, or unset it to use {modules_dir}/{release}/build"
    )


def _missing(release: str, checked: list[str]) -> HeadersMissing:
    """No headers anywhere: each place checked, and how to install or mount them."""
    return HeadersMissing(
        f"no kernel headers for {release}: "
        + "; ".join(checked)
        + ". Fix: install the headers of the running kernel (Debian/Ubuntu: apt-get install "
        f"linux-headers-{release}; Fedora/RHEL: dnf install kernel-devel-{release}); in a pod, "
        "mount the host's /lib/modules and /usr/src read-only at the same paths; or set "
        "BCC_KERNEL_SOURCE to a configured header tree. On a machine whose kernel has no header "
        "package, scripts/prepare-bpf-host.sh (make deps) links Debian's generic headers."
    )


def _single_tree_problem(path: str) -> str | None:
    if not os.path.isdir(path):
        return "no such directory"
    if not os.path.isfile(os.path.join(path, KCONFIG)):
        return f"no {KCONFIG} in it"
    if not os.path.isfile(os.path.join(path, AUTOCONF)):
        return f"no {AUTOCONF} in it (an unconfigured tree: use the build directory of the kernel)"
    return None


def _resolve(path: str, root: str) -> str:
    """Follow symlinks of a path inside a mounted root, re-anchoring absolute targets there."""
    for _ in range(40):
        if not os.path.islink(path):
            return path
        target = os.readlink(path)
        path = (
            root + target if os.path.isabs(target) else os.path.join(os.path.dirname(path), target)
        )
        path = os.path.normpath(path)
    return path


def _modules_tree(kdir: str, root: str) -> tuple[HeaderTree | None, str]:
    if not os.path.isdir(kdir):
        return None, f"{kdir} does not exist"
    build = _resolve(f"{kdir}/build", root) if root else f"{kdir}/build"
    source = _resolve(f"{kdir}/source", root) if root else f"{kdir}/source"
    if not os.path.isdir(build):
        return None, _missing_dir(f"{kdir}/build", build)
    source_problem = ""
    if not os.path.isdir(source):
        source_problem = (
            _missing_dir(f"{kdir}/source", source) if os.path.lexists(f"{kdir}/source") else ""
        )
        source = build
    if not os.path.isfile(os.path.join(source, KCONFIG)):
        where = f"{kdir}/source" if source != build else f"{kdir}/build"
        return None, f"{where} has no {KCONFIG}" + (
            f" and {source_problem}" if source_problem else ""
        )
    if not os.path.isfile(os.path.join(build, AUTOCONF)):
        return None, f"{kdir}/build has no {AUTOCONF}"
    if not root:
        return HeaderTree(
            source, build, f"{kdir}/build" + (" + source" if source != build else "")
        ), ""
    # Inside a host mount bcc cannot use its own /lib/modules lookup: give it the
    # source tree and add the build tree's generated headers as bcc would.
    arch = _ARCH.get(platform.machine(), platform.machine())
    cflags = (
        ()
        if source == build
        else (
            f"-I{build}/arch/{arch}/include/generated/uapi",
            f"-I{build}/arch/{arch}/include/generated",
            f"-I{build}/include",
            f"-I{build}/include/generated/uapi",
        )
    )
    return HeaderTree(
        source, build, f"{kdir} (host mount)", {"BCC_KERNEL_SOURCE": source}, cflags
    ), ""


def _missing_dir(link: str, resolved: str) -> str:
    if os.path.islink(link):
        shown = resolved if resolved != link else os.readlink(link)
        return f"{link} points to {shown}, which does not exist (install or mount it)"
    return f"{link} does not exist"
