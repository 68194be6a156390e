"""`auto` falling back from one source to the next (eBPF to procfs) is logged at WARNING with
the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import Agent

pytestmark = pytest.mark.e2e


def test_ebpf_losing_to_procfs_is_a_warning_with_the_reason(tmp_path: Path) -> None:
    # A /proc of another pid namespace: the ebpf source refuses it (its pids would not match),
    # procfs runs.
    (tmp_path / "1" / "ns").mkdir(parents=True)
    (tmp_path / "1" / "ns" / "pid").symlink_to("pid:[4026530000]")
    with Agent("--procfs", str(tmp_path), ready=False) as agent:
        agent.wait_for(lambda: "takes its place" in agent.output(), what="the fallback warning")
        (line,) = [line for line in agent.output().splitlines() if "takes its place" in line]
    assert " WARNING " in line and "source ebpf is unavailable, procfs takes its place" in line, (
        line
    )
    assert "pid namespace 4026530000" in line or "pid:[4026530000]" in line, line
