"""The NVLinks of a GPU: state and traffic per link each sample, error counters less often."""

from __future__ import annotations

import pynvml

from kepler_bridge.model import NvLink
from kepler_bridge.sources.nvml.device import Device

# nvmlDeviceGetNvLinkErrorCounter's counters, named as the gpu_nvlink_errors_total kinds.
ERROR_KINDS = (
    (pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, "crc_flit"),
    (pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA, "crc_data"),
    (pynvml.NVML_NVLINK_ERROR_DL_REPLAY, "replay"),
    (pynvml.NVML_NVLINK_ERROR_DL_RECOVERY, "recovery"),
)
# Per-link traffic in KiB since the driver loaded. These fields (Ampere and newer) replace
# nvmlDeviceGetNvLinkUtilizationCounter, which needs counters set up and is deprecated.
TRAFFIC = (
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
)


def nvlinks(device: Device) -> tuple[NvLink, ...]:
    """Every NVLink of the GPU; none where it has none. A link that is down has no counters."""
    count = _link_count(device)
    if not count:
        device.link_errors.clear()
        return ()
    states = [(link, _state(device, link)) for link in range(count)]
    up = [link for link, state in states if state]
    traffic = _traffic(device, up)
    for link in set(device.link_errors) - set(up):
        del device.link_errors[link]  # read again as soon as it is back
    return tuple(
        NvLink(link, True, *traffic.get(link, (None, None)), _errors(device, link))
        if state
        else NvLink(link, False)
        for link, state in states
        if state is not None
    )


def _link_count(device: Device) -> int:
    """The GPU's NVLinks; a GPU without any (or that cannot say) is not asked again."""
    values = device.query(
        "nvlink",
        pynvml.nvmlDeviceGetFieldValues,
        device.handle,
        [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT],
    )
    if values is None:
        return 0
    value = values[0]
    count = value.value.uiVal if value.nvmlReturn == pynvml.NVML_SUCCESS else 0
    if not 0 < count <= pynvml.NVML_NVLINK_MAX_LINKS:
        device.cannot("nvlink")
        return 0
    return count


def _state(device: Device, link: int) -> bool | None:
    active = device.query(
        f"nvlink{link}_state", pynvml.nvmlDeviceGetNvLinkState, device.handle, link
    )
    return None if active is None else active == pynvml.NVML_FEATURE_ENABLED


def _traffic(device: Device, links: list[int]) -> dict[int, tuple[int | None, int | None]]:
    """Transmitted and received bytes of each link, in one call."""
    if not links:
        return {}
    values = device.query(
        "nvlink_traffic",
        pynvml.nvmlDeviceGetFieldValues,
        device.handle,
        [(field, link) for link in links for field in TRAFFIC],
    )
    if values is None:
        return {}
    counts = [
        value.value.ullVal * 1024 if value.nvmlReturn == pynvml.NVML_SUCCESS else None
        for value in values
    ]
    return {link: (counts[2 * i], counts[2 * i + 1]) for i, link in enumerate(links)}


def _errors(device: Device, link: int) -> tuple[tuple[str, int], ...]:
    """The link's error counters: slow counters, read when the GPU's are (reliability.py) and
    when the link comes up."""
    if not device.counters_due and link in device.link_errors:
        return device.link_errors[link]
    counts = (
        (
            kind,
            device.query(
                f"nvlink{link}_errors{counter}",
                pynvml.nvmlDeviceGetNvLinkErrorCounter,
                device.handle,
                link,
                counter,
            ),
        )
        for counter, kind in ERROR_KINDS
    )
    errors = tuple((kind, count) for kind, count in counts if count is not None)
    device.link_errors[link] = errors
    return errors
