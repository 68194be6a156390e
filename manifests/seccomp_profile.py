"""The hardened pods' seccomp profile.

It is the default profile of containers-common (podman's and CRI-O's RuntimeDefault),
/usr/share/containers/seccomp.json of Debian bookworm's golang-github-containers-common
0.50.1+ds1-4, copied unchanged, resolved for the hardened capabilities, plus the eBPF system calls
that CAP_BPF and CAP_PERFMON allow (that base allows them only with CAP_SYS_ADMIN), less the
calls through which CAP_SYS_PTRACE acts on another process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SECCOMP_BASE = Path(__file__).resolve().parent / "seccomp" / "containers-common-0.50.1.json"
SECCOMP_EBPF = {"bpf": "CAP_BPF", "perf_event_open": "CAP_PERFMON"}
# What CAP_SYS_PTRACE (the hardened KubeEdge pod's, for /proc/<pid>/environ: edge_devices.py)
# would let the agent do to another process: attach, read or write its memory, take its file
# descriptors. The agent calls none of them; refused in every hardened pod (the base allows them
# all), so that the capability opens the /proc files its access check guards and no more.
SECCOMP_REFUSED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd")
# The ABIs of the image's architectures (amd64, arm64): seccomp's names and those of the base's
# "arches".
SECCOMP_ARCHES = {
    "SCMP_ARCH_X86_64": "amd64",
    "SCMP_ARCH_X86": "x86",
    "SCMP_ARCH_X32": "x32",
    "SCMP_ARCH_AARCH64": "arm64",
    "SCMP_ARCH_ARM": "arm",
}


def seccomp_profile(capabilities: list[str]) -> dict[str, Any]:
    """SECCOMP_BASE for a container with exactly these capabilities on SECCOMP_ARCHES, as a flat
    OCI profile.

    containerd reads Localhost profiles as the OCI runtime spec's LinuxSeccomp, which has no
    conditions: a rule's `includes`/`excludes` (capabilities, architectures) are resolved here, the
    way runtimes resolve their default profile for a container. Then the eBPF system calls are
    allowed for their capabilities, and SECCOMP_REFUSED refused.
    """
    base = json.loads(SECCOMP_BASE.read_text(encoding="utf-8"))
    caps = {f"CAP_{cap}" for cap in capabilities}
    allowed = [name for name, cap in SECCOMP_EBPF.items() if cap in caps]
    rules = []
    for rule in base["syscalls"]:
        includes, excludes = rule.get("includes", {}), rule.get("excludes", {})
        unknown = set(includes) - {"caps", "arches"} | set(excludes) - {"caps"}
        assert not unknown, (
            f"{SECCOMP_BASE.name}: rule {rule['names']} has conditions {unknown} "
            "that seccomp_profile.py ignores"
        )
        if not set(includes.get("caps", [])) <= caps or caps & set(excludes.get("caps", [])):
            continue
        if "arches" in includes and not set(includes["arches"]) & set(SECCOMP_ARCHES.values()):
            continue
        names = [name for name in rule["names"] if name not in (*allowed, *SECCOMP_REFUSED)]
        if names:
            rules.append(
                {"names": names, "action": rule["action"]}
                | {key: rule[key] for key in ("args", "errnoRet") if rule.get(key)}
            )
    rules.append({"names": allowed, "action": "SCMP_ACT_ALLOW"})
    rules.append({"names": list(SECCOMP_REFUSED), "action": "SCMP_ACT_ERRNO", "errnoRet": 1})
    return {
        "defaultAction": base["defaultAction"],
        "defaultErrnoRet": base["defaultErrnoRet"],
        "architectures": list(SECCOMP_ARCHES),
        "syscalls": rules,
    }
