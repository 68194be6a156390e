"""A device keeps its `gpu` index for the agent's life: sources starting late or listing devices in
another order shift no other device, and /v1/collect lists devices in index order."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from agent import Agent
from fakenvml import FakeNvml
from scaffold import samples

GIB = 1024**3
NVIDIA = ("GPU-fa4e0000-0000-4000-8000-000000000000", "GPU-fa4e0000-0000-4000-8000-000000000001")
# Command devices, each with a memory size of its own so /v1/collect entries can be told apart.
CARDS = {"KL-A": 16, "KL-B": 32, "KL-C": 64}
NVML_DRIVER_NOT_LOADED = 9


pytestmark = pytest.mark.e2e


def print_cards(path: Path, *uuids: str) -> None:
    """What the command prints from now on (written whole, so a run never reads half of it)."""
    partial = path.with_suffix(".partial")
    partial.write_text(
        json.dumps(
            {
                "devices": [
                    {
                        "uuid": uuid,
                        "vendor": "kunlun",
                        "usedMemory": GIB,
                        "totalMemory": CARDS[uuid] * GIB,
                    }
                    for uuid in uuids
                ]
            }
        )
    )
    os.replace(partial, path)


def indexes(agent: Agent) -> dict[str, str]:
    """uuid -> gpu label of every device in /metrics."""
    return {
        sample.labels["uuid"]: sample.labels["gpu"] for sample in samples(agent.metrics(), "gpu_up")
    }


def test_late_source_and_reordered_command_shift_no_other_device(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    cards = tmp_path / "cards.json"
    print_cards(cards, "KL-A", "KL-B")
    fake_nvml.set(
        init_error=NVML_DRIVER_NOT_LOADED
    )  # NVML starts late: the driver "loads" after the agent
    with Agent(
        "--sources",
        "nvml",
        "--nvml-library",
        str(fake_nvml.library),
        "--command",
        shlex.join(["cat", str(cards)]),
        "--interval",
        "0.25s",
        env=fake_nvml.env(),
    ) as agent:
        agent.wait_for(
            lambda: indexes(agent) == {"KL-A": "0", "KL-B": "1"}, what="the command's two cards"
        )
        fake_nvml.set(init_error=0)
        expected = {"KL-A": "0", "KL-B": "1", NVIDIA[0]: "2", NVIDIA[1]: "3"}
        agent.wait_for(
            lambda: indexes(agent) == expected, what="NVIDIA GPUs after the command's cards"
        )
        print_cards(
            cards, "KL-C", "KL-B", "KL-A"
        )  # a new card, listed first, and the order reversed
        expected["KL-C"] = "4"
        agent.wait_for(
            lambda: indexes(agent) == expected, what="the new card on the next free index"
        )
        print_cards(cards, "KL-C", "KL-B")
        del expected["KL-A"]
        agent.wait_for(lambda: indexes(agent) == expected, what="KL-A gone, the others unchanged")
        # /v1/collect: index order (KL-B, the two NVIDIA GPUs, KL-C), told apart by their
        # memory sizes.
        totals = [
            device["totalMemory"]
            for device in agent.get("/v1/collect").json()["test-node"]["devices"]
        ]
    assert totals == [32 * GIB, 80 * GIB, 80 * GIB, 64 * GIB]
