"""The ebpf source with the real program loaded: accuracy against /proc, short-lived processes,
descriptors handed over by the loader, memory, and precise errors when eBPF cannot load.

These need root, bcc, bpftool, tracefs and kernel headers (`make deps` provides them).
CI runs them as root and never skips them.
"""

from __future__ import annotations

import json
import struct
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cpu_helpers import Burner, require_bpf, short_lived
from kepler_bridge import config, kernel_headers
from kepler_bridge.sampler import Sampler, SnapshotStore, check_source
from kepler_bridge.sources.base import SourceUnavailable
from kepler_bridge.sources.bpf_syscall import prog_stats
from kepler_bridge.sources.ebpf import EbpfSource, load_program, pid_namespace_problem
from kepler_bridge.sources.ebpf_loader import BTF_PATH, task_tgid_offset

ROOT = Path(__file__).resolve().parents[1]
ID = "e" * 64


@pytest.fixture(scope="module")
def bpf_host() -> None:
    require_bpf()


def make_config(**flags: object) -> config.Config:
    return config.load(flags, {})


@pytest.fixture(params=["auto", "tracepoint"])
def ebpf(bpf_host: None, request: pytest.FixtureRequest):
    """The source loaded both ways: raw tracepoints (this kernel has BTF) and the classic fallback."""
    source = EbpfSource(make_config())
    source.attach = request.param
    source.start()
    expected = "raw tracepoint" if request.param == "auto" else "tracepoint ("
    assert source.loaded.features["sched_switch"].startswith(expected), source.loaded.features
    yield source
    source.stop()


def row_of(source: EbpfSource, pid: int):
    return next((row for row in source.read().processes if row.pid == pid), None)


def test_burn_agrees_with_proc_within_5_percent(ebpf: EbpfSource) -> None:
    with Burner() as burner:
        time.sleep(0.1)
        before = row_of(ebpf, burner.pid)
        assert before is not None, "an idle child that ran since load is tracked"
        proc_before = burner.cpu_seconds()
        burner.burn(1.5)
        after = row_of(ebpf, burner.pid)
        proc_after = burner.cpu_seconds()
    # The growth is measured by the BPF program alone (the first sight was counted from /proc).
    assert after.cpu_seconds - before.cpu_seconds == pytest.approx(proc_after - proc_before, rel=0.05)
    assert after.cpu_seconds == pytest.approx(proc_after, rel=0.05)
    assert after.comm == "python"


def test_running_process_counted_while_it_runs(ebpf: EbpfSource) -> None:
    """A task still on a CPU at read time is counted up to now (in-flight slices), not up to its last switch."""
    with Burner() as burner:
        time.sleep(0.1)
        row_of(ebpf, burner.pid)
        burner.start(3.0)
        time.sleep(1.5)
        during = row_of(ebpf, burner.pid)
        proc_during = burner.cpu_seconds()
        burner.wait()
    assert during.cpu_seconds == pytest.approx(proc_during, rel=0.05)


def test_threads_add_up_to_their_process(ebpf: EbpfSource) -> None:
    """Burning threads (not the main one) are counted for their thread group, also while on a CPU."""
    with Burner(threads=2) as burner:
        time.sleep(0.1)
        before = row_of(ebpf, burner.pid).cpu_seconds
        proc_before = burner.cpu_seconds()
        burner.start(3.0)
        time.sleep(1.0)
        during = row_of(ebpf, burner.pid).cpu_seconds
        proc_during = burner.cpu_seconds()
        burner.wait()
        after = row_of(ebpf, burner.pid).cpu_seconds
        proc_after = burner.cpu_seconds()
    assert during - before == pytest.approx(proc_during - proc_before, rel=0.05)
    assert after - before == pytest.approx(proc_after - proc_before, rel=0.05)


def test_maps_drained_without_batch_operations(ebpf: EbpfSource) -> None:
    """Kernels before 5.6 lack BPF_MAP_LOOKUP_AND_DELETE_BATCH: the per-key fallback counts the same."""
    for bpf_map in ebpf.loaded.maps.values():
        bpf_map._batch_supported = False
    with Burner() as burner:
        time.sleep(0.1)
        before = row_of(ebpf, burner.pid).cpu_seconds
        proc_before = burner.cpu_seconds()
        burner.burn(0.5)
        after = row_of(ebpf, burner.pid).cpu_seconds
        proc_after = burner.cpu_seconds()
    assert after - before == pytest.approx(proc_after - proc_before, rel=0.05)


def test_process_living_50ms_between_two_samples_is_counted(ebpf: EbpfSource) -> None:
    ebpf.read()
    started = time.monotonic()
    pid, used = short_lived(0.03)
    lived = time.monotonic() - started
    assert lived < 0.5
    row = row_of(ebpf, pid)
    assert row is not None, f"pid {pid} lived {lived * 1000:.0f} ms between two samples and was missed"
    assert row.cpu_seconds == pytest.approx(used, rel=0.05, abs=0.003)
    assert row.comm == "python"


def test_short_lived_process_reported_with_its_comm_after_exec(ebpf: EbpfSource) -> None:
    ebpf.read()
    child = subprocess.Popen(["/bin/sh", "-c", "exec /bin/true"])
    child.wait()
    row = row_of(ebpf, child.pid)
    assert row is not None and row.comm == "true"


def test_short_lived_process_in_a_container_cgroup_gets_its_id(ebpf: EbpfSource) -> None:
    """A process gone before the sample is mapped to its container through its cgroup v2 id."""
    unified = next((root for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
                    if (root / "cgroup.controllers").exists()), None)
    assert unified is not None, "no cgroup v2 hierarchy mounted"
    cgroup = unified / "kepler-bridge-ebpf-test" / f"cri-containerd-{ID}.scope"
    cgroup.mkdir(parents=True, exist_ok=True)
    try:
        ebpf.read()
        pid, _ = short_lived(0.03, preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0"))
        row = row_of(ebpf, pid)
        assert row is not None and row.container_id == ID
    finally:
        cgroup.rmdir()
        cgroup.parent.rmdir()


def test_ended_process_kept_for_grace_then_dropped(bpf_host: None) -> None:
    source = EbpfSource(make_config(process_grace="0.5s"))
    source.start()
    try:
        with Burner() as burner:
            time.sleep(0.1)
            source.read()
            burner.burn(0.2)
            pid = burner.pid
        first = row_of(source, pid)
        assert first is not None and first.cpu_seconds >= 0.19
        assert row_of(source, pid).cpu_seconds == first.cpu_seconds
        time.sleep(0.5)
        assert row_of(source, pid) is None
    finally:
        source.stop()


def test_process_count_is_capped(bpf_host: None) -> None:
    source = EbpfSource(make_config(max_processes="3"))
    source.start()
    try:
        with Burner() as burner:
            source.read()
            burner.burn(0.3)
            rows = source.read().processes
            burned = burner.cpu_seconds()
        assert len(rows) == 3 and len(source.table) == 3
        kept = {row.pid: row.cpu_seconds for row in rows}
        assert burner.pid in kept or burned <= min(kept.values()) + 0.01, "the biggest consumers are kept"
    finally:
        source.stop()


def test_tracepoints_stay_attached_after_the_loader_exits_and_detach_on_stop(bpf_host: None) -> None:
    source = EbpfSource(make_config(ebpf_map_entries="4096"))
    source.start()
    children = Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()
    assert not children, f"the loader child should have exited, found {children}"
    assert source.loaded.maps["cpu_ns"].max_entries == 4096
    assert {"sched_switch", "sched_process_exit"} <= set(source.loaded.attached)
    program_id = prog_stats(source.loaded.programs[source.loaded.switch_program]).id
    shown = json.loads(subprocess.check_output(["bpftool", "-j", "prog", "show", "id", str(program_id)]))
    assert shown["type"] == "raw_tracepoint"
    source.read()
    time.sleep(0.3)
    reading = source.read()
    assert reading.ebpf_programs_attached == len(source.loaded.attached)
    assert reading.processes, "sched_switch kept firing after the loader exited"
    source.stop()
    deadline = time.monotonic() + 5
    while subprocess.run(["bpftool", "prog", "show", "id", str(program_id)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the program stayed loaded after stop()"
        time.sleep(0.1)


def test_agent_process_never_holds_bcc_and_stays_small(bpf_host: None) -> None:
    script = textwrap.dedent("""
        import json, sys, time
        from kepler_bridge import config
        from kepler_bridge.sources.ebpf import EbpfSource
        source = EbpfSource(config.load({}, {}))
        source.start()
        for _ in range(3):
            rows = source.read().processes
            time.sleep(0.2)
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        print(json.dumps({"rss_kib": int(status["VmRSS"].split()[0]), "hwm_kib": int(status["VmHWM"].split()[0]),
                          "bcc": "bcc" in sys.modules, "rows": len(rows)}))
    """)
    result = json.loads(subprocess.check_output([sys.executable, "-c", script], cwd=ROOT))
    assert not result["bcc"]
    assert result["rows"] > 0
    # bcc + LLVM alone peak near 130 MB; they only ever live in the loader child.
    assert result["hwm_kib"] < 40 * 1024, result


def test_hidden_headers_say_what_is_missing(bpf_host: None, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "nowhere"))
    with pytest.raises(SourceUnavailable) as raised:
        EbpfSource(make_config()).start()
    message = str(raised.value)
    assert f"BCC_KERNEL_SOURCE={tmp_path / 'nowhere'}" in message and "no such directory" in message
    assert "unset it to use /lib/modules/" in message


def test_broken_header_tree_reports_the_compiler_error(bpf_host: None, tmp_path: Path, monkeypatch) -> None:
    for name in (kernel_headers.KCONFIG, kernel_headers.AUTOCONF):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path))
    with pytest.raises(SourceUnavailable) as raised:
        EbpfSource(make_config()).start()
    message = str(raised.value)
    assert "bcc could not compile or load" in message and "file not found" in message
    assert f"kernel headers from BCC_KERNEL_SOURCE={tmp_path}" in message


def test_auto_falls_back_to_procfs_and_says_why(bpf_host: None, monkeypatch) -> None:
    monkeypatch.setenv("BCC_KERNEL_SOURCE", "/nonexistent-headers")
    cfg = make_config(sources="auto")
    sampler = Sampler(cfg, SnapshotStore())
    try:
        snapshot = sampler.sample()
    finally:
        sampler.stop()
    status = {source.name: source for source in snapshot.sources}
    assert status["procfs"].up
    assert not status["ebpf"].up and "BCC_KERNEL_SOURCE=/nonexistent-headers" in status["ebpf"].error
    assert snapshot.processes
    works, why = check_source("ebpf", cfg)
    assert not works and "BCC_KERNEL_SOURCE" in why


def test_doctor_line_reports_programs_and_extras(bpf_host: None) -> None:
    works, line = check_source("ebpf", make_config())
    assert works, line
    assert "sched_switch via raw tracepoint" in line and "kernel headers from" in line
    assert "softirq" in line and "hardware counters" in line


def test_headers_from_a_host_mount(bpf_host: None, tmp_path: Path) -> None:
    """Headers under a host root mounted in the pod (--procfs /host/proc) are found and compile."""
    local = kernel_headers.find()
    host = tmp_path / "host"
    modules = host / "lib" / "modules" / "host-kernel"
    modules.mkdir(parents=True)
    # As on the host: absolute links, valid only inside the host's root.
    (modules / "build").symlink_to(os.path.realpath(local.build))
    (modules / "source").symlink_to(os.path.realpath(local.source))
    (host / "usr").mkdir()
    (host / "usr" / "src").symlink_to("/usr/src")
    (host / "proc").symlink_to("/proc")
    headers = kernel_headers.find(release="host-kernel", procfs=str(host / "proc"))
    assert headers.origin.endswith("(host mount)")
    assert headers.environ["BCC_KERNEL_SOURCE"].startswith(str(host))
    loaded = load_program(1024, headers)
    try:
        assert "sched_switch" in loaded.attached
    finally:
        loaded.close()


def test_hardware_counter_code_passes_the_verifier(bpf_host: None) -> None:
    """The per-process cycles/instructions code loads even where no counters exist to open."""
    loaded = load_program(1024, kernel_headers.find(), hw_counters="compile")
    try:
        assert {"hw_count", "cycles_event", "instructions_event"} <= set(loaded.maps)
        assert list(loaded.maps["hw_count"].drain()) == []
    finally:
        loaded.close()


def test_unprivileged_agent_is_told_to_run_as_root(bpf_host: None) -> None:
    script = ("from kepler_bridge import config\nfrom kepler_bridge.sources.ebpf import EbpfSource\n"
              "try:\n    EbpfSource(config.load({}, {})).start()\nexcept Exception as err:\n    print(err)\n")
    # Root without CAP_SYS_ADMIN, CAP_BPF and CAP_PERFMON, as in an unprivileged container.
    dropped = ["setpriv", "--bounding-set", "-sys_admin,-bpf,-perfmon", "--"]
    result = subprocess.run([*dropped, sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert "needs root" in result.stdout, result.stdout + result.stderr


def test_foreign_pid_namespace_is_refused(tmp_path: Path) -> None:
    (tmp_path / "1" / "ns").mkdir(parents=True)
    (tmp_path / "1" / "ns" / "pid").symlink_to("pid:[4026532001]")
    problem = pid_namespace_problem(str(tmp_path))
    assert "hostPID: true" in problem and "--procfs /host/proc" in problem


def test_task_struct_tgid_offset_matches_bpftool(bpf_host: None) -> None:
    dump = subprocess.run(["bpftool", "btf", "dump", "file", BTF_PATH, "format", "raw"],
                          capture_output=True, text=True, check=True).stdout
    task_struct = dump[dump.index("STRUCT 'task_struct'"):]
    bits = int(task_struct.split("'tgid' ", 1)[1].split("bits_offset=", 1)[1].split()[0])
    assert task_tgid_offset() == bits // 8


def _btf_type(name_off: int, kind: int, vlen: int, size_or_type: int, *extra: int) -> bytes:
    """struct btf_type followed by its kind-specific u32 words."""
    return struct.pack(f"<III{len(extra)}I", name_off, kind << 24 | vlen, size_or_type, *extra)


def test_task_struct_tgid_offset_inside_an_anonymous_struct(tmp_path: Path) -> None:
    """Randomized task_struct layouts put members in anonymous structs: offsets add up."""
    strings = b"\0int\0pid\0tgid\0task_struct\0state\0"
    name = {word: strings.index(b"\0" + word + b"\0") + 1
            for word in (b"int", b"pid", b"tgid", b"task_struct", b"state")}
    int_, struct_, typedef = 1, 4, 8
    types = b"".join([
        _btf_type(name[b"int"], int_, 0, 4, 32),  # [1] int
        _btf_type(0, struct_, 2, 8, name[b"pid"], 1, 0, name[b"tgid"], 1, 32),  # [2] struct { int pid, tgid; }
        _btf_type(0, typedef, 0, 2),  # [3] a modifier in front of [2]
        _btf_type(name[b"task_struct"], struct_, 2, 24, name[b"state"], 1, 0, 0, 3, 64),  # [4] state; <anon> at byte 8
    ])
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    path = tmp_path / "vmlinux"
    path.write_bytes(header + types + strings)
    assert task_tgid_offset(str(path)) == 12
    assert task_tgid_offset(str(tmp_path / "missing")) is None
