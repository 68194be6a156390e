"""CPU accounting through the whole agent (`kepler-bridge serve`), scraped over HTTP."""

from __future__ import annotations

import os
import subprocess

import pytest

from agent import KEPLER_BRIDGE, Agent
from cpu_helpers import Burner, container_cgroup, require_bpf, short_lived
from scaffold import by_name, values

ID = "f" * 64


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bpf_host() -> None:
    require_bpf()


def samples(agent: Agent, name: str) -> list[tuple[dict[str, str], float]]:
    return by_name(agent.metrics()).get(name, [])


def process_seconds(agent: Agent, pid: int) -> float | None:
    return next(
        (
            value
            for labels, value in samples(agent, "kepler_bridge_process_cpu_seconds_total")
            if labels["pid"] == str(pid)
        ),
        None,
    )


def source_up(agent: Agent) -> dict[str, float]:
    return values(agent.metrics(), "kepler_bridge_source_up", "source")


@pytest.mark.parametrize("source", ["ebpf", "procfs"])
def test_burn_agrees_with_proc_through_metrics(bpf_host: None, source: str) -> None:
    with (
        Agent("--sources", source, "--interval", "200ms", "--process-metrics", "all") as agent,
        Burner() as burner,
    ):
        agent.wait_for(
            lambda: process_seconds(agent, burner.pid) is not None, what="the child is exported"
        )
        burner.burn(1.0)
        expected = burner.cpu_seconds()
        value = agent.wait_for(
            lambda: (
                (v := process_seconds(agent, burner.pid))
                and abs(v - expected) <= 0.05 * expected
                and v
            ),
            what=f"counter near {expected}",
        )
        assert value >= 0.95
        assert source_up(agent)[source] == 1


def test_process_living_30ms_is_exported(bpf_host: None) -> None:
    with Agent("--sources", "ebpf", "--interval", "1s", "--process-metrics", "all") as agent:
        pid, used = short_lived(0.03)
        value = agent.wait_for(
            lambda: process_seconds(agent, pid), what=f"short-lived pid {pid} exported"
        )
        assert value == pytest.approx(used, rel=0.01, abs=0.0005)


def test_container_totals_and_programs_attached(bpf_host: None) -> None:
    with (
        container_cgroup("e2e-test", ID) as cgroup,
        Agent("--sources", "ebpf", "--interval", "200ms") as agent,
    ):
        with Burner(preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0")) as burner:
            burner.burn(0.5)
            used = burner.cpu_seconds()

        def container_total() -> float | None:
            return next(
                (
                    value
                    for labels, value in samples(agent, "kepler_bridge_container_cpu_seconds_total")
                    if labels["container_id"] == ID and value >= 0.95 * used
                ),
                None,
            )

        agent.wait_for(container_total, what="the container's total")
        assert samples(agent, "kepler_bridge_ebpf_programs_attached")[0][1] == 2
        rss = samples(agent, "process_resident_memory_bytes")[0][1]
        assert rss < 45 * 1024 * 1024, f"agent RSS {rss / 2**20:.0f} MiB with eBPF loaded"


def test_auto_falls_back_to_procfs_when_headers_are_hidden(bpf_host: None) -> None:
    with Agent(
        "--sources", "auto", "--interval", "200ms", env={"BCC_KERNEL_SOURCE": "/nonexistent"}
    ) as agent:
        up = agent.wait_for(
            lambda: (up := source_up(agent)) and "procfs" in up and up, what="source_up"
        )
        # eBPF stands by for procfs, which runs: it is not down,
        # so it has a state but no source_up series.
        assert "ebpf" not in up and up["procfs"] == 1
        assert agent.source_states()["ebpf"] == "standby"
        assert samples(agent, "kepler_bridge_process_cpu_seconds_total")


def test_doctor_says_why_ebpf_is_not_used(bpf_host: None) -> None:
    result = subprocess.run(
        [KEPLER_BRIDGE, "doctor"],
        env={**os.environ, "BCC_KERNEL_SOURCE": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if len(line.split()) > 1}
    assert (
        lines["ebpf"].startswith("no")
        and "BCC_KERNEL_SOURCE=/nonexistent: no such directory" in lines["ebpf"]
    )
    assert lines["procfs"].startswith("ok")
