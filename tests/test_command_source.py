"""The command source: its JSON schema (a superset of the BIE collector body),
the runner's limits, the agent."""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import KEPLER_BRIDGE, Agent
from kepler_bridge.config import ConfigError, load
from kepler_bridge.model import MAX_DEVICES
from kepler_bridge.sampling import state_file
from kepler_bridge.sources.cgroup import cgroup2_root
from kepler_bridge.sources.command import OutputError, parse
from kepler_bridge.sources.containment import CGROUP_PREFIX
from kepler_bridge.sources.runner import CommandFailed, run
from scaffold import require, samples, wait_for

EXAMPLES = Path(__file__).parent.parent / "examples" / "command"
GIB = 1024**3
# The fixed body of the BIE guide's demo collector, verbatim.
BIE_DEMO = {
    "docker-desktop": {
        "deviceNum": 2,
        "devices": [
            {"percent": 0.1, "totalMemory": 1000, "usedMemory": 100},
            {"percent": 0.1008991008991009, "totalMemory": 1001, "usedMemory": 101},
        ],
        "percent": 0.10044977511244378,
        "totalMemory": 2001,
        "usedMemory": 201,
    }
}
GOOD = {
    "devices": [
        {
            "uuid": "KL-R200-01",
            "vendor": "kunlun",
            "model": "Kunlun R200",
            "driverVersion": "4.0.25",
            "pciBusId": "0000:3b:00.0",
            "usedMemory": 2 * GIB,
            "totalMemory": 16 * GIB,
            "utilization": 0.35,
            "memoryUtilization": 0.1,
            "temperature": 55,
            "memoryTemperature": 60,
            "power": 75.5,
            "powerLimit": 150,
            "energy": 12345.5,
            "coreClock": 1.2e9,
            "memoryClock": 1.6e9,
            "fanSpeed": 0.3,
        },
        {"vendor": "cambricon", "model": "MLU370-S4", "usedMemory": 0, "totalMemory": 24 * GIB},
    ]
}

# One script for every behaviour; the mode file says which,
# so one agent run can go through them all.
MODAL = """
import json, os, sys, time
mode = open(sys.argv[1]).read().strip()
if mode == "good":
    print(json.dumps(%r))
elif mode == "malformed":
    print('{"devices": [{"usedMemory": 1')
elif mode == "huge":
    sys.stdout.write("x" * (3 << 20))
elif mode == "many":
    # 900 kB: under the output cap
    print(json.dumps({"devices": [{}] * 300000}, separators=(",", ":")))
elif mode == "failing":
    sys.stderr.write("warming up\\nxpu-smi: device 1 is busy\\n")
    sys.exit(3)
elif mode == "slow":
    child = os.fork()
    if child == 0:
        time.sleep(60)
    open(sys.argv[2], "w").write(f"{os.getpid()} {child}")
    time.sleep(60)
""" % (GOOD,)


def modal_command(tmp_path: Path, mode: str) -> tuple[str, Path, Path]:
    """(--command value, mode file, pid file) of the modal script."""
    script, mode_file, pid_file = tmp_path / "modal.py", tmp_path / "mode", tmp_path / "pids"
    script.write_text(MODAL)
    mode_file.write_text(mode)
    return (
        shlex.join([sys.executable, str(script), str(mode_file), str(pid_file)]),
        mode_file,
        pid_file,
    )


def test_the_extended_schema_in_contract_units() -> None:
    first, second = parse(json.dumps(GOOD))
    assert (
        first.index,
        first.uuid,
        first.vendor,
        first.model,
        first.driver_version,
        first.pci_bus_id,
    ) == (0, "KL-R200-01", "kunlun", "Kunlun R200", "4.0.25", "0000:3b:00.0")
    assert (first.memory_used_bytes, first.memory_total_bytes, first.memory_free_bytes) == (
        2 * GIB,
        16 * GIB,
        14 * GIB,
    )
    assert (first.utilization, first.memory_utilization, first.fan_speed_ratio) == (0.35, 0.1, 0.3)
    assert (first.temperature_celsius, first.memory_temperature_celsius) == (55, 60)
    assert (first.power_watts, first.power_limit_watts, first.energy_joules) == (75.5, 150, 12345.5)
    assert (first.sm_clock_hertz, first.memory_clock_hertz) == (1.2e9, 1.6e9)
    assert (second.uuid, second.vendor, second.up, second.utilization) == (
        "cambricon-1",
        "cambricon",
        True,
        None,
    )


def test_a_bie_collector_body_is_accepted_as_it_is() -> None:
    devices = parse(json.dumps(BIE_DEMO))
    assert [
        (gpu.uuid, gpu.vendor, gpu.memory_used_bytes, gpu.memory_total_bytes) for gpu in devices
    ] == [("custom-0", "custom", 100, 1000), ("custom-1", "custom", 101, 1001)]


def test_out_of_range_values_are_dropped_not_fatal() -> None:
    (gpu,) = parse(
        json.dumps(
            {
                "devices": [
                    {
                        "uuid": "a",
                        "utilization": 35,
                        "temperature": 300,
                        "power": -1,
                        "usedMemory": -5,
                        "totalMemory": 2**64,
                        "fanSpeed": 1.5,
                        "energy": float("nan"),
                        "coreClock": 0,
                        "memoryClock": int("9" * 400),  # float() of it overflows
                        "unknownKey": "ignored",
                    }
                ]
            }
        )
    )
    assert gpu.up
    assert gpu.memory_clock_hertz is None
    assert all(
        value is None
        for value in (
            gpu.utilization,
            gpu.temperature_celsius,
            gpu.power_watts,
            gpu.memory_used_bytes,
            gpu.memory_total_bytes,
            gpu.fan_speed_ratio,
            gpu.energy_joules,
            gpu.sm_clock_hertz,
        )
    )


def test_a_go_collectors_null_devices_are_no_devices() -> None:
    assert parse('{"devices": null}') == ()
    assert parse('{"edge-1": {"deviceNum": 0, "devices": null, "usedMemory": 0}}') == ()


def test_more_devices_than_a_source_may_report_are_refused() -> None:
    assert len(parse(json.dumps({"devices": [{}] * MAX_DEVICES}))) == MAX_DEVICES
    with pytest.raises(
        OutputError, match=f'"devices": {MAX_DEVICES + 1} devices, more than the {MAX_DEVICES}'
    ):
        parse(json.dumps({"devices": [{}] * (MAX_DEVICES + 1)}))


def test_a_device_the_command_reports_down() -> None:
    (gpu,) = parse(
        '{"devices": [{"uuid": "a", "up": false, "error": "PCIe link lost", "usedMemory": 5}]}'
    )
    assert not gpu.up and gpu.error == "PCIe link lost"


@pytest.mark.parametrize(
    "text,message",
    [
        ("{not json", "is not JSON: line 1 column 2"),
        ("[1, 2]", "top level: expected a JSON object, got list"),
        ('{"gpus": []}', '"devices": expected a list'),
        ('{"devices": [3]}', "devices[0]: expected an object, got int"),
        (
            '{"devices": [{"usedMemory": "100"}]}',
            "devices[0].usedMemory: expected a number, got '100'",
        ),
        ('{"devices": [{"power": true}]}', "devices[0].power: expected a number, got True"),
        ('{"devices": [{"model": 7}]}', "devices[0].model: expected a string, got 7"),
        ('{"devices": [{"up": "yes"}]}', "devices[0].up: expected true or false"),
        ('{"devices": [{"uuid": "x"}, {"uuid": "x"}]}', "devices[1].uuid: 'x' repeats devices[0]"),
        # A bidi mark is stripped from what is shown: the two uuids would merge into one device.
        (
            '{"devices": [{"uuid": "x\\u200e"}, {"uuid": "x"}]}',
            "devices[1].uuid: 'x' repeats devices[0]",
        ),
    ],
)
def test_malformed_output_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(
        OutputError, match="command output " + message.replace("[", r"\[").replace("(", r"\(")
    ):
        parse(text)


def test_runner_limits(tmp_path: Path) -> None:
    python = sys.executable
    assert run([python, "-c", "print('ok')"], 5) == "ok\n"
    with pytest.raises(CommandFailed, match=r"python\S* exited with status 3: last line"):
        run([python, "-c", "import sys; sys.stderr.write('first\\nlast line\\n'); sys.exit(3)"], 5)
    with pytest.raises(CommandFailed, match="printed more than 1048576 bytes and was stopped"):
        run([python, "-c", "import sys; sys.stdout.write('x' * (2 << 20))"], 5)
    with pytest.raises(CommandFailed, match="killed by SIGKILL"):
        run([python, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], 5)
    with pytest.raises(CommandFailed, match="cannot run .*: Permission denied"):
        run([str(Path(__file__))], 5)
    started = time.monotonic()
    with pytest.raises(
        CommandFailed, match=r"did not finish within 0\.3s \(--command-timeout\) and was killed"
    ):
        run(["/bin/sh", "-c", f"sleep 30 & echo $! > {tmp_path / 'child'}; sleep 30"], 0.3)
    assert time.monotonic() - started < 2
    _assert_gone(
        int((tmp_path / "child").read_text())
    )  # the whole process group died, not only the shell


# Starts a daemon the classic way (fork, setsid, fork, stdio to /dev/null), which leaves the
# program's process group; it writes "<pid> <its cgroup v2 path>" to argv[1]. The program then hangs
# (argv[2] == "hang") or prints its readings and exits.
DAEMONIZING = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        cgroup = next(line[3:] for line in open("/proc/self/cgroup").read().splitlines() + ["0::"]
                      if line.startswith("0::"))
        with open(sys.argv[1] + ".tmp", "w") as file:
            file.write(f"{os.getpid()} {cgroup}")
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(60)
    os._exit(0)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
if sys.argv[2] == "hang":
    time.sleep(60)
print('{"devices": []}')
"""


def own_run_cgroups() -> list[Path]:
    """The cgroups this process's runs made (and should have removed)."""
    root = cgroup2_root("/sys")
    return list(Path(root).rglob(f"{CGROUP_PREFIX}{os.getpid()}-*")) if root else []


def cgroup_writable() -> bool:
    root = cgroup2_root("/sys")
    probe = Path(root, f"kepler-bridge-test-probe-{os.getpid()}")
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


@pytest.mark.parametrize("mode", ["hang", "exit"])
def test_a_child_that_leaves_the_process_group_dies_with_the_run(mode: str, tmp_path: Path) -> None:
    daemon = tmp_path / "daemon"
    command = [sys.executable, "-c", DAEMONIZING, str(daemon), mode]
    if mode == "hang":
        with pytest.raises(CommandFailed, match=r"did not finish within 1s"):
            run(command, 1)
    else:
        assert run(command, 5) == '{"devices": []}\n'
    pid, _, cgroup = daemon.read_text().partition(" ")
    _assert_gone(int(pid))
    if cgroup_writable():
        assert f"/{CGROUP_PREFIX}{os.getpid()}-" in cgroup  # it ran in the run's own cgroup
    assert own_run_cgroups() == []


# Runs the daemonizing program (argv[2]) as above, where no cgroup can be created;
# argv[1] is its pid file.
WITHOUT_CGROUPS = """
import sys
from kepler_bridge.sources.runner import CommandFailed, run
try:
    run([sys.executable, "-c", sys.argv[2], sys.argv[1], "hang"], 1)
except CommandFailed as err:
    print(err)
"""


def test_without_a_writable_cgroup_the_agent_reaps_what_a_run_left(tmp_path: Path) -> None:
    require(
        os.geteuid() == 0 and shutil.which("unshare") is not None,
        "needs root and unshare(1): the test hides the cgroup hierarchy in a mount namespace",
    )
    daemon = tmp_path / "daemon"
    hide = 'mount -t tmpfs none /sys/fs/cgroup && exec "$@"'
    result = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            hide,
            "sh",
            sys.executable,
            "-c",
            WITHOUT_CGROUPS,
            str(daemon),
            DAEMONIZING,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "did not finish within 1s (--command-timeout) and was killed" in result.stdout
    pid, _, cgroup = daemon.read_text().partition(" ")
    assert CGROUP_PREFIX not in cgroup
    _assert_gone(int(pid))


def test_a_real_time_signal_is_named_by_its_number() -> None:
    number = signal.SIGRTMIN + 6
    with pytest.raises(CommandFailed, match=rf"python\S* was killed by signal {number}$"):
        run([sys.executable, "-c", f"import os; os.kill(os.getpid(), {number})"], 5)


def test_terminal_escapes_are_stripped_from_stderr() -> None:
    noisy = r"\x1b[1;31merror:\x1b[0m \x1b]0;pwned\x07disk\x07 full\r\x1b[2K\x00!\n"
    with pytest.raises(CommandFailed, match=r"exited with status 2: error: disk full!$"):
        run([sys.executable, "-c", f"import sys; sys.stderr.write('{noisy}'); sys.exit(2)"], 5)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(noise=st.binary(max_size=64))
def test_no_control_character_of_stderr_reaches_the_message(noise: bytes, tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    stderr.write_bytes(noise)
    with pytest.raises(CommandFailed) as failed:
        run(["/bin/sh", "-c", 'cat "$1" >&2; exit 1', "sh", str(stderr)], 5)
    assert not any(
        ord(char) < 0x20 and char != "\t" or 0x7F <= ord(char) <= 0x9F for char in str(failed.value)
    )


def _assert_gone(pid: int) -> None:
    """The process is gone, or a zombie waiting for a parent that does not reap
    (PID 1 of some sandboxes)."""
    wait_for(lambda: _gone(pid), 5, f"pid {pid} to end", step=0.05)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")
    raise AssertionError(f"process {pid} is still running")


def test_settings(tmp_path: Path) -> None:
    config = load({"command": f"{sys.executable} -c 'print(1)'", "command_timeout": "750ms"}, {})
    assert config.command == (sys.executable, "-c", "print(1)") and config.command_timeout == 0.75
    file = tmp_path / "c.yaml"
    file.write_text(f"command: [{sys.executable}, --version]\n")
    assert load({"config": str(file)}, {}).command == (sys.executable, "--version")
    assert load({}, {"KEPLER_BRIDGE_COMMAND": "python3 x.py"}).command == ("python3", "x.py")
    for flags in (
        {"command": "/no/such/collector"},
        {"command": "'unclosed"},
        {"command_timeout": "0s"},
        {"command_timeout": "1h"},
    ):
        with pytest.raises(ConfigError):
            load(flags, {})


@pytest.mark.e2e
def test_a_bad_command_setting_stops_start_up_with_exit_2() -> None:
    result = subprocess.run(
        [KEPLER_BRIDGE, "serve", "--command", "/no/such/collector --json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "bad setting command=" in result.stderr
    assert "expected an executable that exists" in result.stderr


@pytest.mark.e2e
def test_every_failure_is_a_clear_source_error_and_the_agent_keeps_serving(tmp_path: Path) -> None:
    command, mode, pids = modal_command(tmp_path, "good")
    with Agent(
        "--sources",
        "command",
        "--command",
        command,
        "--command-timeout",
        "0.5s",
        "--interval",
        "0.25s",
    ) as agent:
        text = agent.metrics()
        assert agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}
        assert agent.samples("gpu_power_watts") == {"0": 75.5}
        assert 'model="Kunlun R200",node="test-node",uuid="KL-R200-01",vendor="kunlun"' in text
        body = agent.get("/v1/collect").json()["test-node"]
        assert (
            body["deviceNum"] == 2
            and body["usedMemory"] == 2 * GIB
            and body["totalMemory"] == 40 * GIB
        )

        for name, expected in (
            ("malformed", "command output is not JSON: line 2 column 1"),
            ("huge", "printed more than 1048576 bytes and was stopped"),
            ("many", '"devices": 300000 devices, more than the 256 a source may report'),
            ("failing", "exited with status 3: xpu-smi: device 1 is busy"),
            ("slow", "did not finish within 0.5s (--command-timeout) and was killed"),
        ):
            mode.write_text(name)
            reason = agent.wait_for(lambda: _down_reason(agent, expected), what=f"{name} reported")
            assert expected in reason
            assert agent.samples("gpu_up") == {
                "0": 0.0,
                "1": 0.0,
            }  # the devices keep their places, down
            assert agent.get("/v1/collect").json()["test-node"]["deviceNum"] == 2
            for _ in range(10):  # answered from the last snapshot, also while a run is in progress
                assert agent.get("/metrics").status_code == 200
        # A slow command (it sleeps 60 s) holds the sampler for the timeout only,
        # and dies with its children.
        assert agent.samples("kepler_bridge_sample_duration_seconds")[""] < 30
        for pid in map(int, pids.read_text().split()):
            _assert_gone(pid)
        mode.write_text("good")
        agent.wait_for(
            lambda: agent.samples("gpu_up") == {"0": 1.0, "1": 1.0}, timeout=15, what="recovery"
        )
        assert agent.samples("kepler_bridge_source_up") == {"": 1.0}


# Eight devices that no run before listed: uuids from a run counter kept in the file "$1",
# replaced whole (a rename), so the test never reads it truncated while a run writes it.
INVENTING = """\
n=$(( $(cat "$1") + 1 )); echo $n > "$1.new"; mv "$1.new" "$1"
printf '{"devices":['
for i in 1 2 3 4 5 6 7 8; do
  [ $i = 1 ] || printf ,
  printf '{"uuid":"new-%d-%d","usedMemory":1,"totalMemory":2,"power":50,"energy":%d}' $n $i $n
done
echo ']}'
"""


@pytest.mark.e2e
def test_devices_invented_every_run_are_forgotten_and_cost_bounded_state(tmp_path: Path) -> None:
    script, runs = tmp_path / "inventing.sh", tmp_path / "runs"
    script.write_text(INVENTING)
    runs.write_text("0")
    # 8 new devices a sample, 10 samples a second, each kept 1 s after its last run: about 88.
    bound = 8 * 14
    with Agent(
        "--sources",
        "command",
        "--command",
        shlex.join(["sh", str(script), str(runs)]),
        "--interval",
        "0.1s",
        "--device-grace",
        "1s",
    ) as agent:
        (state,) = [
            path / state_file.FILE
            for place in ("/dev/shm", tempfile.gettempdir())
            for path in Path(place).glob(f"kepler-bridge-{agent.process.pid}-*")
        ]
        sizes, series = [], []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            uuids = {s.labels["uuid"] for s in samples(agent.metrics()) if "uuid" in s.labels}
            series.append(len(uuids))
            sizes.append(len(json.loads(state.read_text())["devices"]["devices"]))
            time.sleep(0.5)
        made = int(runs.read_text()) * 8
    assert made > 3 * bound, f"only {made} devices invented: the test proves nothing"
    assert max(series) <= bound, f"devices in /metrics over time: {series}"
    assert max(sizes) <= bound, f"devices in the state file over time: {sizes}"


def _down_reason(agent: Agent, expected: str) -> str:
    response = agent.get("/readyz")
    reason = response.json()["reason"]
    return reason if response.status_code == 503 and expected in reason else ""


@pytest.mark.e2e
def test_the_template_example() -> None:
    result = subprocess.run(
        [
            KEPLER_BRIDGE,
            "collect",
            "--json",
            "--sources",
            "command",
            "--node-name",
            "edge-1",
            "--command",
            str(EXAMPLES / "template.sh"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "edge-1": {
            "deviceNum": 1,
            "devices": [{"usedMemory": GIB, "totalMemory": 8 * GIB, "percent": 0.125}],
            "usedMemory": GIB,
            "totalMemory": 8 * GIB,
            "percent": 0.125,
        }
    }


@pytest.mark.e2e
def test_the_bie_collector_example_bridges_an_existing_collector() -> None:
    class Collector(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(BIE_DEMO).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1/collect"
    try:
        command = shlex.join([sys.executable, str(EXAMPLES / "bie-collector.py"), url])
        with Agent("--sources", "command", "--command", command, "--interval", "0.25s") as agent:
            # The agent answers exactly what the BIE guide's demo collector answers,
            # under its own node name.
            assert agent.get("/v1/collect").json() == {"test-node": BIE_DEMO["docker-desktop"]}
    finally:
        server.shutdown()
        server.server_close()
