"""What a source's texts (its error messages, the names it reports) reach, and where.

With a token or basic-auth users set, the open endpoints tell no error text; names from a command
or a plug-in reach no endpoint with escape codes or control characters in them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import bcrypt
import pytest
import yaml

from agent import KEPLER_BRIDGE, Agent

pytestmark = pytest.mark.e2e

SECRET = "hunter2"
FAILING = f"""#!/bin/sh
echo "loading /opt/vendor/lib/libxpu.so.3 from https://10.0.0.1:6443 with SECRET_TOKEN={SECRET}" >&2
exit 3
"""
PASSWORD = "s3cret pass"
TOKEN = "t0ken"

# Escape codes and controls a hostile name may carry: CSI, OSC ... BEL, BEL, C1 CSI, RLO.
HOSTILE = ("\x1b[31m", "\x1b]0;pwned\x07", "\x07", "\x9b", "\u202e")
NAMED = {
    "uuid": "XPU-\x1b[31m0\x1b[0m",
    "vendor": "acme\x07",
    "model": "\x1b]0;pwned\x07Model \x9b\u202eX",
    "driverVersion": "1.\u202e2",
    "pciBusId": "0000:01:00.0\x1b[2K\n\t",
}
PLUGIN = r"""
from kepler_bridge.model import GpuReading, SourceReading
from kepler_bridge.sources.base import Source

class Hostile(Source):
    name = "hostile"
    def start(self):
        pass
    def read(self):
        gpu = GpuReading(
            index=0, uuid="PLUG-\x1b[1m7", vendor="plug\x9b", model="\u202eledoM",
            driver_version="\x1b]8;;http://x\x07v", mig_uuids=("MIG-\x07a",),
            throttled=(("hot\x1b[0m", True),),
        )
        return SourceReading(gpus=(gpu,))

class Failing(Hostile):
    name = "failing"
    def read(self):
        raise RuntimeError("\x1b[31mboom\x1b[0m\n2026-01-01 WARNING forged line\u202e")
"""


def _failing(tmp_path: Path) -> Path:
    script = tmp_path / "xpu-smi"
    script.write_text(FAILING)
    script.chmod(0o755)
    return script


def _auth_args(mode: str, tmp_path: Path) -> tuple[list[str], dict]:
    """The agent's flags for an auth mode (token or users), and the credentials a scraper
    sends."""
    if mode == "token":
        (tmp_path / "token").write_text(TOKEN + "\n")
        token_args = ["--auth-token-file", str(tmp_path / "token")]
        return token_args, {"headers": {"Authorization": f"Bearer {TOKEN}"}}
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(yaml.safe_dump({"basic_auth_users": {"alice": hashed}}))
    return ["--web.config.file", str(tmp_path / "web.yml")], {"auth": ("alice", PASSWORD)}


@pytest.mark.parametrize("mode", ["token", "users"])
def test_with_auth_the_open_endpoints_tell_states_not_error_texts(
    mode: str, tmp_path: Path
) -> None:
    args, credentials = _auth_args(mode, tmp_path)
    command = ["--sources", "command", "--command", str(_failing(tmp_path))]
    with Agent(*command, "--interval", "0.25s", *args, ready=False) as agent:
        agent.wait_for(
            lambda: SECRET in agent.get("/readyz", **credentials).text,
            what="/readyz with credentials giving the command's error",
        )
        full = agent.get("/readyz", **credentials)
        assert full.status_code == 503
        assert SECRET in full.json()["sources"]["command"]["reason"]
        wrong = (
            {"headers": {"Authorization": "Bearer wrong"}}
            if mode == "token"
            else {"auth": ("alice", "wrong")}
        )
        for anonymous in ({}, wrong):
            ready = agent.get("/readyz", **anonymous)
            assert ready.status_code == 503, anonymous
            assert ready.json() == {
                "ready": False,
                "reason": "no source is up (command: down)",
                "sources": {"command": {"state": "down"}},
            }, anonymous
        for path in (
            "/readyz",
            "/healthz",
            "/v1/collect",
            "/",
            "/api/v1/history",
            "/metrics",
            "/x",
        ):
            body = agent.get(path).text
            assert all(leak not in body for leak in (SECRET, "libxpu", "10.0.0.1")), path
        assert SECRET in agent.get("/", **credentials).text
        assert SECRET in agent.get("/api/v1/history", **credentials).text
        # The operator finds the reason in the log.
        agent.wait_for(lambda: f"SECRET_TOKEN={SECRET}" in agent.output(), what="error logged")


def test_without_auth_readyz_tells_the_error_texts_as_before(tmp_path: Path) -> None:
    command = ["--sources", "command", "--command", str(_failing(tmp_path))]
    with Agent(*command, "--interval", "0.25s", ready=False) as agent:
        agent.wait_for(lambda: SECRET in agent.get("/readyz").text, what="the error in /readyz")
        ready = agent.get("/readyz")
        body = ready.json()
        assert ready.status_code == 503 and body["ready"] is False
        assert "xpu-smi exited with status 3" in body["reason"] and SECRET in body["reason"]
        assert body["sources"]["command"]["state"] == "down"
        assert SECRET in body["sources"]["command"]["reason"]


def _clean(text: str) -> bool:
    return not any(hostile in text for hostile in HOSTILE) and not any(
        ord(char) < 0x20 and char not in "\t\n" or 0x7F <= ord(char) <= 0x9F for char in text
    )


def _decoded(text: str) -> str:
    """JSON with its escapes resolved, so an escaped control character shows as itself."""
    return json.dumps(json.loads(text), ensure_ascii=False)


def _plugin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    info = site / "kb_hostile-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kb-hostile\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[kepler_bridge.sources]\nhostile = kb_hostile:Hostile\nfailing = kb_hostile:Failing\n"
    )
    (site / "kb_hostile.py").write_text(PLUGIN)
    return site


def test_names_from_a_command_or_a_plugin_reach_no_endpoint_with_control_characters(
    tmp_path: Path,
) -> None:
    (tmp_path / "readings.json").write_text(json.dumps({"devices": [NAMED]}))
    script = tmp_path / "collector"
    script.write_text(f"#!/bin/sh\nexec cat {tmp_path / 'readings.json'}\n")
    script.chmod(0o755)
    site = _plugin_site(tmp_path)
    args = ["--sources", "command,hostile,failing", "--command", str(script), "--interval", "0.25s"]
    with Agent(*args, env={"PYTHONPATH": str(site)}) as agent:
        metrics = agent.wait_for(
            lambda: 'gpu="1"' in (text := agent.metrics()) and text, what="both devices"
        )
        assert 'uuid="XPU-0"' in metrics and 'uuid="PLUG-7"' in metrics, metrics
        assert 'model="Model X"' in metrics and 'model="ledoM"' in metrics
        assert 'pci_bus_id="0000:01:00.0"' in metrics and 'reason="hot"' in metrics
        assert _clean(metrics)
        history = _decoded(agent.get("/api/v1/history").text)
        assert "XPU-0" in history and "PLUG-7" in history and _clean(history)
        assert _clean(_decoded(agent.get("/v1/collect").text))
        assert _clean(agent.get("/").text)
        ready = _decoded(agent.get("/readyz").text)
        assert "boom2026-01-01 WARNING forged line" in ready and _clean(ready)
        agent.wait_for(lambda: "failing failed: boom" in agent.output(), what="the failure logged")
        assert _clean(agent.output())
    doctor = subprocess.run(
        [KEPLER_BRIDGE, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**agent.env, "PYTHONPATH": str(site)},
    )
    assert "acme Model X" in doctor.stdout and "plug ledoM" in doctor.stdout, doctor.stdout
    assert _clean(doctor.stdout), doctor.stdout
