"""What the hardened KubeEdge DaemonSet adds to the hardened pod: CAP_SYS_PTRACE, so that the
agent can learn which container holds which device from its processes' environment.

EdgeCore serves no pod-resources socket, so on an edge node the environment is the only way.
Opening /proc/<pid>/environ passes the kernel's ptrace access check (mode READ_FSCREDS): without
CAP_SYS_PTRACE it fails for a process of another uid, one that is not dumpable, or one whose
permitted capabilities are not within the agent's effective ones, which is nearly every other
container's. A container of another uid also keeps its environ (mode 0400) from an agent
without CAP_DAC_READ_SEARCH, which is not added (manifests/README.md). The seccomp profile, the
same for every hardened pod, refuses the calls through which the capability would act on
another process (seccomp_profile.SECCOMP_REFUSED): reading environ is open and read.
"""

from __future__ import annotations

from typing import Any, Callable

ENVIRON_CAPABILITY = "SYS_PTRACE"
COMMENT = (
    "# CAP_SYS_PTRACE: the kernel's ptrace access check on /proc/<pid>/environ, which the agent\n"
    "# reads for the device variables because EdgeCore serves no pod-resources socket\n"
    "# (manifests/README.md, Devices without pod-resources; --device-environment off reads none).\n"
)


def edge_daemonset(
    workload: dict[str, Any], hardened: bool, documents: Callable[[dict[str, Any]], str]
) -> str:
    """The KubeEdge DaemonSet's file: the hardened one with ENVIRON_CAPABILITY added, and a
    comment that says why above it."""
    if not hardened:
        return documents(workload)
    (agent,) = workload["spec"]["template"]["spec"]["containers"]
    capabilities = agent["securityContext"]["capabilities"]
    capabilities["add"] = [*capabilities["add"], ENVIRON_CAPABILITY]  # a copy: the list is shared
    text = documents(workload)
    line = f"- {ENVIRON_CAPABILITY}\n"
    indent = text[: text.index(line)].rsplit("\n", 1)[1]
    commented = "".join(indent + part for part in COMMENT.splitlines(keepends=True))
    return text.replace(indent + line, commented + indent + line, 1)
