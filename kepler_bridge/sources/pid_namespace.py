"""Which pid namespace a process is in: the host's (initial) one, or one of its own."""

from __future__ import annotations

import os

# PROC_PID_INIT_INO: the initial pid namespace, whose pids BPF helpers and the host's /proc give.
INITIAL = "pid:[4026531836]"
OWN = "/proc/self/ns/pid"


def namespace(link: str = OWN) -> str:
    """The target of a /proc/<pid>/ns/pid link, such as 'pid:[4026531836]'; '' where it cannot
    be read."""
    try:
        return os.readlink(link)
    except OSError:
        return ""


def nested(link: str = OWN) -> bool:
    """Whether the process of `link` is in a pid namespace other than the initial one (False
    where that cannot be told)."""
    return namespace(link) not in ("", INITIAL)
