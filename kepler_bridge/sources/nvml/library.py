"""Finding, loading and initialising libnvidia-ml.so.1, each failure saying what to fix."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pynvml

from kepler_bridge.sources.base import SourceAbsent, SourceUnavailable

# Where driver packages put libnvidia-ml.so.1 under a /usr tree, searched when --nvml-library is a
# directory: Debian/Ubuntu amd64 and arm64 (Grace), Jetson (JetPack's tegra/), RHEL/SUSE, NVIDIA's
# container images.
LIBRARY = "libnvidia-ml.so.1"
LIBRARY_DIRS = (
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/aarch64-linux-gnu/tegra",
    "lib64",
    "local/nvidia/lib64",
    "lib",
)


def load(path: str) -> None:
    """Give pynvml the library --nvml-library names (a file, or a /usr tree to search), once.

    With no path pynvml finds the system's library itself.
    """
    if not path or pynvml.nvmlLib is not None:
        return
    if Path(path).is_dir():
        pynvml.nvmlLib = search(Path(path))
        return
    if not Path(path).exists():
        raise SourceUnavailable(
            f"--nvml-library {path} does not exist: give the path of libnvidia-ml.so.1"
        )
    try:
        pynvml.nvmlLib = ctypes.CDLL(path)
    except OSError as err:
        raise SourceUnavailable(f"--nvml-library {path} cannot be loaded: {err}") from None


def search(directory: Path) -> ctypes.CDLL:
    """The first libnvidia-ml.so.1 in `directory` or its LIBRARY_DIRS that loads here.

    One built for another architecture does not load, and the next is tried.
    """
    candidates = [
        directory / sub / LIBRARY
        for sub in ("", *LIBRARY_DIRS)
        if (directory / sub / LIBRARY).exists()
    ]
    if not candidates:
        raise SourceAbsent(
            f"no {LIBRARY} in {directory} or its {', '.join(LIBRARY_DIRS)}: install the NVIDIA "
            "driver, or pass --nvml-library the library's path"
        )
    failures = []
    for candidate in candidates:
        try:
            return ctypes.CDLL(str(candidate))
        except OSError as err:
            failures.append(str(err))
    raise SourceUnavailable(f"no {LIBRARY} under {directory} can be loaded: {'; '.join(failures)}")


def init() -> None:
    """nvmlInit, its failures as SourceUnavailable saying what to fix."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise SourceUnavailable(
            "libnvidia-ml.so.1 not found: install the NVIDIA driver, mount the host's "
            "driver libraries, or pass --nvml-library PATH"
        ) from None
    except pynvml.NVMLError_LibRmVersionMismatch:
        raise SourceUnavailable(
            "NVML library and kernel driver versions differ: reboot the node or reload "
            "the nvidia kernel module after a driver upgrade"
        ) from None
    except pynvml.NVMLError_DriverNotLoaded:
        raise SourceUnavailable(
            "the NVIDIA kernel driver is not loaded: check `nvidia-smi` on the host "
            "and load the driver (modprobe nvidia)"
        ) from None
    except pynvml.NVMLError as err:
        raise SourceUnavailable(f"nvmlInit failed: {err}; check `nvidia-smi` on the host") from None
