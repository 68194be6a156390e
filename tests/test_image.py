"""The real image: built from the Dockerfile with podman (default and `slim` targets) and run with
the settings of the privileged, the hardened and the Ascend DaemonSet, read from their manifests;
checked from outside over loopback and with `kepler-bridge doctor` inside.

No container registry is reachable, so the base image is built from this machine's Debian mirror
(scripts/debian-base-image.sh) and imported as docker.io/library/debian:bookworm-slim. podman runs
with its own configuration and storage under CACHE (kept between runs: a second run reuses the base
image and the layers).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
import requests
import yaml

from fixtures.ascend import ascend_host
from image_signing import Registry, generate_key_pair, refusal, sign
from kepler_bridge import __version__
from podman_store import BASE, CACHE, CONTEXT, LABEL, Podman, podman_with_base
from scaffold import free_port, require, samples, wait_for
from simple_signing import Keyring, lookaside, signature_file, signed_by_policy

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
PRIVILEGED = MANIFESTS / "kubernetes" / "30-daemonset.yaml"
HARDENED = MANIFESTS / "kubernetes" / "hardened" / "30-daemonset.yaml"
ASCEND = MANIFESTS / "kubernetes" / "ascend" / "30-daemonset.yaml"
KUBEEDGE_HARDENED = MANIFESTS / "kubeedge" / "hardened" / "30-daemonset.yaml"
# The Ascend host files the ascend DaemonSet mounts (this machine has none:
# a fake host stands in for them).
ASCEND_PATHS = ("/usr/local/Ascend/driver", "/usr/local/sbin/npu-smi", "/etc/ascend_install.info")
# The folder the install step copies to the kubelet's /var/lib/kubelet/seccomp
# (manifests/README.md).
KUBELET_SECCOMP = MANIFESTS / "seccomp"
IMAGES = {"full": "localhost/kepler-bridge:test", "slim": "localhost/kepler-bridge:test-slim"}
NODE = "image-test-node"
START_SECONDS = (
    120  # the manifests' startup probe: 60 tries 2 s apart, for bcc's compile at start-up
)


class Run(NamedTuple):
    """One container of `containers`: a manifest's pod, with what the test changes in it."""

    name: str
    manifest: Path
    image: str  # a key of IMAGES
    seccomp: dict[str, str] | None = None  # replaces the manifest's profile
    host_pid: bool | None = None  # replaces the manifest's hostPID
    env: tuple[str, ...] = ()  # NAME=value added to the manifest's


# The hardened pod under the runtime's default profile shows the shipped profile is what lets eBPF
# load; the slim image has no bcc; the hardened pod without the host's pid namespace shows what
# works without hostPID (every process's CPU series, to find one host process among all).
RUNS = [
    Run("privileged", PRIVILEGED, "full"),
    Run("hardened", HARDENED, "full"),
    Run("hardened-runtime-default", HARDENED, "full", seccomp={"type": "RuntimeDefault"}),
    Run(
        "hardened-no-host-pid",
        HARDENED,
        "full",
        host_pid=False,
        env=("KEPLER_BRIDGE_PROCESS_METRICS=all",),
    ),
    Run("slim", HARDENED, "slim"),
    # SYS_PTRACE, for the environ of other containers; slim: bcc's compile is not what it shows.
    Run("hardened-kubeedge", KUBEEDGE_HARDENED, "slim"),
    Run("ascend", ASCEND, "full"),
]
# Burns a little CPU, then becomes `sleep`: a host process with CPU time and a known comm.
BUSY_THEN_SLEEP = "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; exec sleep 300"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", autouse=True)
def root() -> None:
    require(os.geteuid() == 0, "not root: podman builds and runs the image only as root here")


@pytest.fixture(scope="module")
def podman() -> Podman:
    return podman_with_base(CACHE)


@pytest.fixture(scope="module")
def images(podman: Podman) -> dict[str, str]:
    for target in ("slim", "full"):
        podman(
            "build",
            *podman.build_options,
            "--target",
            target,
            "--tag",
            IMAGES[target],
            str(CONTEXT),
            timeout=1800,
        )
    return IMAGES


@pytest.fixture(scope="module")
def host_usr(tmp_path_factory: pytest.TempPathFactory, fakenvml_lib: Path) -> Path:
    """Stands in for the host's /usr (the privileged pod's nvidia-driver volume): this machine
    has no NVIDIA driver, so the fake library (no configuration: "driver not loaded") lies where
    Debian's driver puts it."""
    usr = tmp_path_factory.mktemp("host") / "usr"
    (usr / "lib" / f"{platform.machine()}-linux-gnu").mkdir(parents=True)
    shutil.copy(fakenvml_lib, usr / "lib" / f"{platform.machine()}-linux-gnu" / "libnvidia-ml.so.1")
    return usr


def _quantity(value: str) -> str:
    """A Kubernetes memory quantity as podman writes it (256Mi -> 256m)."""
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if value.endswith(suffix):
            return value[:-2] + unit
    return value + "b"


def _cpus(value: str) -> str:
    return str(int(value[:-1]) / 1000) if value.endswith("m") else value


def run_options(
    run: Run, port: int, workdir: Path, host_paths: dict[str, Path]
) -> tuple[list[str], list[str]]:
    """`podman run` options for the agent container of a run's manifest,
    and the container's arguments.

    The one setting not from the manifest or the run: the container shares this machine's network
    (loopback only) and listens on `port` of 127.0.0.1. `host_paths` replaces hostPath sources
    this machine lacks.
    """
    manifest = run.manifest
    (workload,) = [doc for doc in yaml.safe_load_all(manifest.read_text(encoding="utf-8")) if doc]
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Kubernetes runs the probes (checked here as /healthz and /readyz),
    # not the image's HEALTHCHECK.
    options = [
        "--no-healthcheck",
        "--network",
        "host",
        "--env",
        f"KEPLER_BRIDGE_LISTEN=127.0.0.1:{port}",
    ]
    if pod.get("hostPID") if run.host_pid is None else run.host_pid:
        options += ["--pid", "host"]
    security = container["securityContext"]
    if security.get("privileged"):
        options.append("--privileged")
    if "runAsUser" in security:
        options += ["--user", str(security["runAsUser"])]
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    for cap in security.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", cap]
    for cap in security.get("capabilities", {}).get("add", []):
        options += ["--cap-add", f"CAP_{cap}"]
    profile = run.seccomp or security.get("seccompProfile", {"type": "RuntimeDefault"})
    if profile["type"] == "Localhost":
        options += ["--security-opt", f"seccomp={KUBELET_SECCOMP / profile['localhostProfile']}"]
    elif profile["type"] == "Unconfined":
        options += ["--security-opt", "seccomp=unconfined"]
    limits = container["resources"]["limits"]
    options += ["--memory", _quantity(limits["memory"]), "--cpus", _cpus(limits["cpu"])]
    for env in container["env"]:
        if "value" in env:
            options += ["--env", f"{env['name']}={env['value']}"]
        elif env["valueFrom"].get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            options += ["--env", f"{env['name']}={NODE}"]
        else:
            pytest.fail(
                f"{manifest}: env {env['name']} comes from {env['valueFrom']}, "
                "which this test cannot give: add it to run_options",
                pytrace=False,
            )
    for setting in run.env:
        options += ["--env", setting]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            source = host_paths.get(volume["hostPath"]["path"], Path(volume["hostPath"]["path"]))
            if not source.exists():
                if volume["hostPath"].get("type") != "DirectoryOrCreate":
                    pytest.fail(
                        f"{manifest}: hostPath {source} is missing on this machine", pytrace=False
                    )
                source = (
                    workdir / mount["name"]
                )  # what the kubelet would create, without touching this machine
                source.mkdir(exist_ok=True)
            mode = "ro" if mount.get("readOnly") else "rw"
            options += ["--volume", f"{source}:{mount['mountPath']}:{mode}"]
        elif volume.get("emptyDir", {}).get("medium") == "Memory":
            size = _quantity(volume["emptyDir"].get("sizeLimit", "64Mi"))
            options += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-size={size}"]
        else:
            pytest.fail(
                f"{manifest}: volume {volume} is of a kind this test cannot mount: add it",
                pytrace=False,
            )
    command = container.get("command")
    if command:
        options += ["--entrypoint", json.dumps(command)]
    return options, container.get("args", [])


class Container:
    """One agent container started from a manifest; `url` is its listen address on loopback."""

    def __init__(
        self, podman: Podman, name: str, image: str, options: list[str], args: list[str], port: int
    ):
        self.podman, self.name, self.args = podman, f"kepler-bridge-test-{name}-{os.getpid()}", args
        self.url = f"http://127.0.0.1:{port}"
        podman(
            "run",
            "--detach",
            "--name",
            self.name,
            "--label",
            f"{LABEL}={os.getpid()}",
            *options,
            image,
            *args,
        )

    def logs(self) -> str:
        result = self.podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        state = self.podman(
            "inspect", "--format", "{{.State.Running}}", self.name, check=False
        ).stdout
        return state.strip() == "true"

    def wait(self, path: str, seconds: float) -> requests.Response:
        """The first 200 answer of `path`, within `seconds`."""
        deadline, last = time.monotonic() + seconds, "no answer"
        while time.monotonic() < deadline:
            try:
                answer = requests.get(self.url + path, timeout=5)
                if answer.status_code == 200:
                    return answer
                last = f"{answer.status_code} {answer.text[:300]}"
            except requests.ConnectionError as err:
                last = str(err)
                if not self.running():
                    break
            except requests.Timeout as err:
                # A failed try, as the kubelet counts a probe past its timeoutSeconds (5).
                last = f"no answer within 5 s ({err})"
            time.sleep(1)
        pytest.fail(
            f"{self.name}: {path} not 200 within {seconds:.0f}s ({last}); "
            f"running={self.running()}; "
            f"logs:\n{self.logs()[-4000:]}",
            pytrace=False,
        )

    def doctor(self) -> dict[str, str]:
        """`kepler-bridge doctor` inside, with the settings of the container's `serve`:
        source -> its line."""
        result = self.podman(
            "exec", self.name, "kepler-bridge", "doctor", *self.args[1:], timeout=120
        )
        return {
            line.split()[1]: line for line in result.stdout.splitlines() if len(line.split()) > 1
        }

    def remove(self) -> None:
        self.podman("rm", "--force", "--time", "2", self.name, check=False)


@pytest.fixture(scope="module")
def containers(
    podman: Podman, images: dict[str, str], host_usr: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Container]]:
    """Every run of RUNS, started together (bcc compiles in each, at the manifests' CPU limit)."""
    ascend = tmp_path_factory.mktemp("ascend-host")
    ascend_host(ascend)
    host_paths = {"/usr": host_usr, **{path: ascend / path.lstrip("/") for path in ASCEND_PATHS}}
    started: dict[str, Container] = {}
    try:
        for run in RUNS:
            port = free_port()
            options, args = run_options(run, port, tmp_path_factory.mktemp(run.name), host_paths)
            started[run.name] = Container(podman, run.name, images[run.image], options, args, port)
        yield started
    finally:
        for container in started.values():
            container.remove()


def _metrics(container: Container) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = container.wait("/metrics", 10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for sample in samples(text)
    }


def _source_up(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {
        dict(labels)["source"]: value
        for (name, labels), value in metrics.items()
        if name == "kepler_bridge_source_up"
    }


def _source_states(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, str]:
    return {
        dict(labels)["source"]: dict(labels)["state"]
        for (name, labels), value in metrics.items()
        if name == "kepler_bridge_source_state" and value == 1
    }


def _serves(container: Container) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Live, ready, and answering both formats for this node; returns the metrics."""
    container.wait("/healthz", START_SECONDS)
    ready = container.wait("/readyz", 30)
    assert ready.json()["ready"] is True
    metrics = _metrics(container)
    assert metrics[("kepler_bridge_build_info", (("node", NODE), ("version", __version__)))] == 1
    collect = container.wait("/v1/collect", 10).json()
    assert list(collect) == [NODE]
    assert collect[NODE]["deviceNum"] == len(collect[NODE]["devices"])
    return metrics


def _fallback_warnings(container: Container) -> list[str]:
    return [
        line
        for line in container.logs().splitlines()
        if " WARNING " in line and "takes its place" in line
    ]


def test_slim_image_is_smaller_and_has_no_bcc(podman: Podman, images: dict[str, str]) -> None:
    sizes = {
        target: int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout)
        for target, tag in images.items()
    }
    assert sizes["slim"] < sizes["full"], sizes
    probe = ("python3", "-c", "import bcc")
    assert (
        podman(
            "run",
            "--rm",
            "--network",
            "host",
            "--entrypoint",
            probe[0],
            images["full"],
            *probe[1:],
            check=False,
        ).returncode
        == 0
    ), "the default image imports bcc"
    assert (
        podman(
            "run",
            "--rm",
            "--network",
            "host",
            "--entrypoint",
            probe[0],
            images["slim"],
            *probe[1:],
            check=False,
        ).returncode
        != 0
    ), "the slim image has no bcc"


def test_image_keeps_its_healthcheck(podman: Podman, images: dict[str, str]) -> None:
    for tag in images.values():
        check = json.loads(
            podman("image", "inspect", "--format", "{{json .HealthCheck}}", tag).stdout
        )
        assert "/healthz" in " ".join(check["Test"]), check


def test_privileged_daemonset_has_ebpf_and_finds_the_driver_library(
    containers: dict[str, Container],
) -> None:
    container = containers["privileged"]
    metrics = _serves(container)
    up = _source_up(metrics)
    assert up["ebpf"] == 1, container.doctor()["ebpf"]
    assert metrics[("kepler_bridge_ebpf_programs_attached", (("node", NODE),))] > 0
    # The manifest mounts the host's /usr and names it: the library was found and loaded,
    # but this machine has no NVIDIA GPU (nor driver), so nvml is absent, not down.
    assert "nvml" not in up and _source_states(metrics)["nvml"] == "absent"
    doctor = container.doctor()
    assert doctor["ebpf"].startswith("ok"), doctor["ebpf"]
    assert doctor["procfs"].startswith("ok"), doctor["procfs"]
    assert doctor["nvml"].startswith("no") and "kernel driver is not loaded" in doctor["nvml"], (
        doctor["nvml"]
    )
    assert not _fallback_warnings(container)


def test_hardened_daemonset_with_its_seccomp_profile_has_ebpf(
    containers: dict[str, Container],
) -> None:
    container = containers["hardened"]
    metrics = _serves(container)
    assert _source_up(metrics)["ebpf"] == 1, container.doctor()["ebpf"]
    doctor = container.doctor()
    assert doctor["ebpf"].startswith("ok"), doctor["ebpf"]
    assert not _fallback_warnings(container)


def test_hardened_daemonset_under_the_default_profile_falls_back_with_a_warning(
    containers: dict[str, Container],
) -> None:
    container = containers["hardened-runtime-default"]
    metrics = _serves(container)
    up = _source_up(metrics)
    assert "ebpf" not in up and up["procfs"] == 1 and _source_states(metrics)["ebpf"] == "standby"
    (warning,) = _fallback_warnings(container)
    assert (
        "source ebpf is unavailable, procfs takes its place" in warning
        and "not permitted" in warning
    ), warning


def test_hardened_pod_without_host_pid_falls_back_to_procfs_with_host_pids(
    containers: dict[str, Container],
) -> None:
    """Without hostPID the kernel's task iterator walks only the pod's own pid namespace, so eBPF
    is refused with the reason; the host's /proc at --procfs still names every host process by
    its host pid, so procfs accounts the CPU time (NVML's process list needs hostPID too:
    tests/test_pid_namespace.py)."""
    container = containers["hardened-no-host-pid"]
    inside = container.podman("exec", container.name, "readlink", "/proc/self/ns/pid").stdout
    assert inside.strip() != os.readlink("/proc/self/ns/pid"), "the container has its own pid ns"
    metrics = _serves(container)
    up = _source_up(metrics)
    assert "ebpf" not in up and up["procfs"] == 1 and _source_states(metrics)["ebpf"] == "standby"
    (warning,) = _fallback_warnings(container)
    assert "source ebpf is unavailable, procfs takes its place" in warning, warning
    assert "task iterator sees only the processes of that namespace" in warning, warning
    assert "hostPID: true" in warning, warning
    agent = {
        int(line.split()[0])
        for line in container.podman("top", container.name, "hpid").stdout.splitlines()[1:]
    }
    host = subprocess.Popen(["sh", "-c", BUSY_THEN_SLEEP])
    try:
        seen = wait_for(
            lambda: (found := _cpu_processes(container)).get(host.pid) == "sleep" and found,
            60,
            f"host process {host.pid} (sleep) in kepler_bridge_process_cpu_seconds_total",
            step=1,
            log=container.logs,
        )
    finally:
        host.kill()
        host.wait()
    assert any(seen.get(pid) == "kepler-bridge" for pid in agent), (agent, seen)


def _cpu_processes(container: Container) -> dict[int, str]:
    """pid -> comm of the process CPU series."""
    return {
        int(dict(labels)["pid"]): dict(labels)["comm"]
        for (name, labels), _ in _metrics(container).items()
        if name == "kepler_bridge_process_cpu_seconds_total" and dict(labels)["pid"] != "other"
    }


def test_ascend_daemonset_runs_the_hosts_npu_smi_with_its_driver(
    containers: dict[str, Container],
) -> None:
    container = containers["ascend"]
    metrics = _serves(container)
    assert _source_states(metrics)["ascend"] == "up", container.doctor()["ascend"]
    up = [
        value
        for (name, labels), value in metrics.items()
        if name == "gpu_up" and ("vendor", "huawei") in labels
    ]
    assert up == [1.0, 1.0], "the two chips of the recorded 910B table"
    assert container.doctor()["ascend"].startswith("ok")


def test_slim_image_accounts_cpu_from_procfs(containers: dict[str, Container]) -> None:
    container = containers["slim"]
    metrics = _serves(container)
    up = _source_up(metrics)
    assert "ebpf" not in up and up["procfs"] == 1 and _source_states(metrics)["ebpf"] == "standby"
    assert any(name == "kepler_bridge_process_cpu_seconds_total" for name, _ in metrics)
    (warning,) = _fallback_warnings(container)
    assert "source ebpf is unavailable, procfs takes its place" in warning and "bcc" in warning, (
        warning
    )
    doctor = container.doctor()
    assert doctor["ebpf"].startswith("no") and doctor["procfs"].startswith("ok"), doctor


# Inside a container: whether it holds CAP_SYS_PTRACE, then for each host pid: open its environ,
# try to attach to it; prints the outcomes.
PEEK = """
import ctypes, sys
effective = [line for line in open("/proc/self/status") if line.startswith("CapEff")][0]
print("sys_ptrace", bool(int(effective.split()[1], 16) >> 19 & 1))
libc = ctypes.CDLL(None, use_errno=True)
for pid in map(int, sys.argv[1:]):
    try:
        data = open(f"/host/proc/{pid}/environ", "rb").read()
        print("read", b"NVIDIA_VISIBLE_DEVICES=GPU-image-test" in data)
    except OSError as err:
        print("open", err.errno)
    print("attach", libc.ptrace(16, pid, None, None), ctypes.get_errno())  # PTRACE_ATTACH
"""


def test_hardened_kubeedge_pod_reads_containers_environ_and_attaches_to_none(
    containers: dict[str, Container],
) -> None:
    """The hardened KubeEdge DaemonSet holds CAP_SYS_PTRACE and reads a root process's environ;
    a process of another uid keeps its 0400 environ (DAC: CAP_DAC_READ_SEARCH, which no manifest
    adds); the seccomp profile refuses attaching (EPERM), which the capability would allow."""
    hosts = [
        subprocess.Popen(
            ["sleep", "300"],
            env={"NVIDIA_VISIBLE_DEVICES": "GPU-image-test"},
            **({"user": 65534, "group": 65534, "extra_groups": []} if other else {}),
        )
        for other in (False, True)
    ]
    try:
        for pid in (host.pid for host in hosts):
            wait_for(lambda pid=pid: b"GPU-image-test" in _environ(pid), 5, "sleep's exec")
        pids = [str(host.pid) for host in hosts]
        seen = {
            name: containers[name]
            .podman("exec", containers[name].name, "python3", "-c", PEEK, *pids)
            .stdout.split("\n")[:5]
            for name in ("hardened-kubeedge", "hardened")
        }
    finally:
        for host in hosts:
            host.kill()
            host.wait()
    assert seen["hardened-kubeedge"] == [
        "sys_ptrace True",
        "read True",
        "attach -1 1",
        "open 13",
        "attach -1 1",
    ], seen
    assert seen["hardened"][0] == "sys_ptrace False" and seen["hardened"][2::2] == [
        "attach -1 1",
        "attach -1 1",
    ], seen
    _serves(containers["hardened-kubeedge"])


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry on loopback for the signing test, stopped at the end."""
    if not shutil.which("docker-registry"):
        pytest.fail(
            "docker-registry not installed: run make deps "
            "(bash scripts/apt-install.sh docker-registry)",
            pytrace=False,
        )
    with Registry(tmp_path_factory.mktemp("registry")) as started:
        yield started


def _signature_policy(path: Path, registry: Registry, public_key: Path, *repos: str) -> Path:
    """A containers-policy.json that refuses every image but those of `repos` signed with the
    key, and the registries.d under $HOME/.config that has podman read sigstore attachments."""
    sigstore = {
        "type": "sigstoreSigned",
        "keyPath": str(public_key),
        "signedIdentity": {"type": "matchRepository"},
    }
    scopes = {f"{registry.host}/{repo}": [sigstore] for repo in repos}
    policy = {"default": [{"type": "reject"}], "transports": {"docker": scopes}}
    (path / "policy.json").write_text(json.dumps(policy, indent=2))
    registries = path / ".config" / "containers" / "registries.d"
    registries.mkdir(parents=True)
    (registries / "test.yaml").write_text(
        f"docker:\n  {registry.host}:\n    use-sigstore-attachments: true\n"
    )
    return path / "policy.json"


def test_policy_admits_the_signed_image_and_refuses_unsigned_tampered_or_foreign_ones(
    podman: Podman, images: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    """cosign's format, checked by our own code (tests/image_signing.py): Debian's podman has
    sigstore disabled, so only its refusal of the unsigned image is podman's own; the test below
    has podman's policy engine admit and refuse GPG-signed images."""
    key, public_key = generate_key_pair(tmp_path / "cosign", "release-password")
    other_key, _ = generate_key_pair(tmp_path / "other", "other-password")
    for image, target in (
        (images["full"], "kepler-bridge:0.1.0"),
        (images["slim"], "kepler-bridge:unsigned"),
        (BASE, "kepler-bridge:tampered"),
        (images["slim"], "kepler-bridge-mirror:0.1.0"),
    ):
        podman("push", "--tls-verify=false", image, f"{registry.host}/{target}", timeout=600)
    signed = sign(registry, "kepler-bridge", "0.1.0", key, "release-password")
    release, tampered_digest = (
        registry.digest("kepler-bridge", tag) for tag in ("0.1.0", "tampered")
    )
    # Other content under the signed name, carrying the release's signature as it is and with its
    # payload rewritten to name the other content.
    original = signed["layers"][0]
    payload = registry.blob("kepler-bridge", original["digest"])
    payload = payload.replace(release.encode(), tampered_digest.encode())
    forged = {**original, "digest": registry.put_blob("kepler-bridge", payload)}
    forged["size"] = len(payload)
    registry.put_signatures(
        "kepler-bridge", tampered_digest, {**signed, "layers": [original, forged]}
    )
    sign(registry, "kepler-bridge-mirror", "0.1.0", other_key, "other-password")
    policy = _signature_policy(
        tmp_path, registry, public_key, "kepler-bridge", "kepler-bridge-mirror"
    )
    # The signed manifest is that of the image make test built (its config is the image).
    manifest = registry.manifest("kepler-bridge", "0.1.0")
    built = podman("image", "inspect", "--format", "{{.Id}}", images["full"]).stdout.strip()
    assert manifest["config"]["digest"] == f"sha256:{built}"
    assert refusal(policy, registry, "kepler-bridge", "0.1.0") == ""
    unsigned = refusal(policy, registry, "kepler-bridge", "unsigned")
    assert unsigned == "a signature was required, but no signature exists"
    tampered = refusal(policy, registry, "kepler-bridge", "tampered")
    assert tampered == (
        f"the signature is for {release}, not {tampered_digest}; "
        "the signature does not verify with the key"
    ), tampered
    foreign = refusal(policy, registry, "kepler-bridge-mirror", "0.1.0")
    assert foreign == "the signature does not verify with the key"
    assert refusal(policy, registry, "elsewhere", "0.1.0") == "rejected by the policy"
    # podman enforces the same file (as CRI-O does on a node) and refuses the unsigned image
    # before it fetches a layer. Debian's build stops at "sigstore disabled" for a signed one.
    pulled = podman(
        "pull",
        "--tls-verify=false",
        "--signature-policy",
        str(policy),
        f"{registry.host}/kepler-bridge:unsigned",
        check=False,
        env={"HOME": str(tmp_path)},
    )
    assert pulled.returncode != 0, pulled.stdout
    assert "A signature was required, but no signature exists" in pulled.stderr, pulled.stderr


def _private_containers_config(home: Path, registry: Registry) -> dict[str, str]:
    """podman's environment for simple signing: $HOME holding the registries.d that names the
    lookaside folder home/lookaside, and a registries.conf without search registries or mirrors
    (not the machine's)."""
    lookaside(home, registry.host, home / "lookaside")
    (home / "registries.conf").write_text("unqualified-search-registries = []\n")
    return {"HOME": str(home), "CONTAINERS_REGISTRIES_CONF": str(home / "registries.conf")}


def test_podmans_own_policy_engine_admits_the_signed_image_and_refuses_unsigned_or_tampered(
    podman: Podman, images: dict[str, str], registry: Registry, tmp_path: Path
) -> None:
    """Enforced by podman (containers/image's `signedBy`, as CRI-O on a node), not by our code:
    the image make test built, signed by `podman push --sign-by` with a GPG key (simple signing:
    Debian's podman has sigstore disabled, see the test above for cosign's format), is admitted
    by a policy that rejects everything else; the unsigned image is refused, and so are the same
    image with the release's signature copied to it or with a forged one, and an image signed
    with another key."""
    env = _private_containers_config(tmp_path, registry)
    store, repo = tmp_path / "lookaside", "gpg/kepler-bridge"
    name = f"{registry.host}/{repo}"
    with Keyring("kepler-bridge release") as release, Keyring("someone else") as other:
        for image, tag, key in (
            (images["full"], "0.1.0", release),
            (images["slim"], "unsigned", None),
            (BASE, "foreign", other),
        ):
            signing = ["--sign-by", key.fingerprint] if key else []
            keys = {"GNUPGHOME": str(key.home)} if key else {}
            podman(
                "push",
                "--tls-verify=false",
                *signing,
                image,
                f"{name}:{tag}",
                timeout=600,
                env={**env, **keys},
            )
        policy = signed_by_policy(
            tmp_path / "policy.json", release.export(tmp_path / "release.asc"), name
        )
        other_fingerprint = other.fingerprint
    # The pulls' own storage, so that the test's cached images stay unsigned (podman stores the
    # signatures with an image); short, for podman limits runroot to 50 characters.
    scratch = Path(tempfile.mkdtemp(prefix="kb-pull-", dir="/tmp"))
    local = ["--root", str(scratch / "storage"), "--runroot", str(scratch / "run")]

    def pull(tag: str) -> subprocess.CompletedProcess:
        return podman(
            *local,
            "pull",
            "--tls-verify=false",
            "--signature-policy",
            str(policy),
            f"{name}:{tag}",
            check=False,
            timeout=600,
            env=env,
        )

    try:
        release_digest, unsigned_digest = (registry.digest(repo, t) for t in ("0.1.0", "unsigned"))
        signature = signature_file(store, repo, release_digest).read_bytes()
        # The unsigned image; then with the release's signature as it is; then with that
        # signature's payload rewritten to name it (the same length: the packets stay well-formed).
        assert signature.count(release_digest.encode()) == 1, "the payload is uncompressed"
        forged = signature.replace(release_digest.encode(), unsigned_digest.encode())
        copied = signature_file(store, repo, unsigned_digest)
        for tampered, reason in (
            (None, "A signature was required, but no signature exists"),
            (signature, f"Signature for digest {release_digest} does not match"),
            (forged, "Invalid GPG signature: gpgme.Signature{Summary:4,"),  # 4: red, bad
        ):
            if tampered is not None:
                copied.parent.mkdir(exist_ok=True)
                copied.write_bytes(tampered)
            refused = pull("unsigned")
            assert refused.returncode != 0, refused.stdout
            assert f"Source image rejected: {reason}" in refused.stderr, refused.stderr
        foreign = pull("foreign")
        assert foreign.returncode != 0, foreign.stdout
        assert "Source image rejected: Invalid GPG signature" in foreign.stderr, foreign.stderr
        assert f'Fingerprint:"{other_fingerprint}"' in foreign.stderr, foreign.stderr
        assert podman(*local, "images", "--quiet").stdout == "", "a refused image was stored"
        admitted = pull("0.1.0")
        assert admitted.returncode == 0, admitted.stderr
        built = podman("image", "inspect", "--format", "{{.Id}}", images["full"]).stdout.strip()
        assert admitted.stdout.split()[-1] == built, "the admitted image is the one make test built"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
