"""The TLS and web-config files as `serve` validated them, handed to each worker: one that starts
while a file is broken (a renewal half written) serves what the agent started with, as a worker
forked from a master that had loaded them would."""

from __future__ import annotations

import os
from typing import Iterable

MOST_BYTES = 1 << 20  # of each file: certificates, keys and web configs are a few KiB


def capture(paths: Iterable[str]) -> dict[str, bytes]:
    """The bytes of each of `paths` that can be read now."""
    found = {}
    for path in paths:
        try:
            with open(path, "rb") as file:
                found[path] = file.read(MOST_BYTES)
        except (OSError, ValueError):  # ValueError: a NUL byte in the path
            continue
    return found


class KeptFiles:
    """Paths that read as the files did when the agent started."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def __contains__(self, path: str) -> bool:
        return path in self.files

    def path(self, original: str) -> str:
        """`/proc/self/fd/N` of a memory file holding what `original` held at the start (for
        readers that take a path, as ssl does); the descriptor lives as long as the process."""
        fd = os.memfd_create("kepler-bridge-kept")
        os.write(fd, self.files[original])
        return f"/proc/self/fd/{fd}"
