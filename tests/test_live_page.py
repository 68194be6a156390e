"""The live page at `/` and its `/api/v1/history` JSON.

The page runs in Debian's headless Chromium against the real agent.
"""

from __future__ import annotations

import dataclasses
import gzip
import html
import json
import re
import sys
import tracemalloc
from pathlib import Path

import pytest
import requests

import scaffold
from agent import Agent
from browser import Browser
from fakenvml import FakeNvml
from kepler_bridge.exposition.history import render as history_json
from kepler_bridge.model import GpuReading, Snapshot
from kepler_bridge.store import MAX_SAMPLES, MAX_SECONDS, History

CHART_PATHS = "[...document.querySelectorAll('#devices svg path')].map((p) => p.getAttribute('d'))"


def charts_drawn(count: int) -> str:
    """JavaScript: the charts' paths once `count` are drawn with two points or more, else false."""
    return (
        f"(() => {{ const d = {CHART_PATHS}; "
        f"return d.length === {count} && d.every((p) => p.includes('L')) && d; }})()"
    )


@pytest.fixture(scope="module")
def agent():
    with Agent("--simulate", "2", "--interval", "0.5s", "--sources", "simulated") as running:
        yield running


def snapshot(timestamp: float, devices: int = 8, interval: float = 1.0) -> Snapshot:
    gpus = tuple(
        GpuReading(
            index=i,
            uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            vendor="nvidia",
            model="H100",
            utilization=(timestamp % 100) / 100,
            memory_used_bytes=2**34 + i,
            temperature_celsius=40.0 + i,
            power_watts=300.25 + timestamp % 7,
        )
        for i in range(devices)
    )
    return Snapshot(
        node="n", timestamp=timestamp, duration_seconds=0.01, interval_seconds=interval, gpus=gpus
    )


@pytest.mark.e2e
def test_page_draws_moving_charts_without_errors(agent: Agent, tmp_path: Path) -> None:
    with Browser(tmp_path / "profile") as browser:
        browser.open(agent.url + "/")
        first = browser.wait_for(charts_drawn(8))  # 2 devices x 4 charts
        moved = agent.wait_for(
            lambda: (paths := browser.evaluate(CHART_PATHS)) != first and paths,
            what="the charts to move",
        )
        assert len(moved) == 8
        text = browser.evaluate("document.body.innerText")
        for expected in (
            "gpu 0 · Simulated Accelerator",
            "gpu 1 · Simulated Accelerator",
            "SIM-0000-0001",
            "utilization",
            "memory",
            "temperature",
            "power",
            "(not in a pod)",
            "simulated\tup",
        ):
            assert expected in text
        assert browser.evaluate("document.querySelectorAll('#pods tr').length") >= 1
        browser.screenshot(tmp_path / "live.png")
        assert browser.problems == []
        assert all(url.startswith(agent.url + "/") for url in browser.requests), browser.requests
        assert {agent.url + "/", agent.url + "/api/v1/history"} <= set(browser.requests)
    assert (tmp_path / "live.png").read_bytes().startswith(b"\x89PNG") and (
        tmp_path / "live.png"
    ).stat().st_size > 10_000


@pytest.mark.e2e
def test_page_is_small_self_contained_and_locked_down(agent: Agent) -> None:
    page = agent.get("/")
    assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert len(page.content) < 50 * 1024
    assert all(
        link.startswith(("/", "data:")) for link in re.findall(r'(?:src|href)="([^"]*)"', page.text)
    )
    policy = page.headers["Content-Security-Policy"]
    assert (
        "default-src 'none'" in policy and "unsafe" not in policy and "connect-src 'self'" in policy
    )
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert "<td>simulated</td>" in page.text and '<b id="node">test-node</b>' in page.text


@pytest.mark.e2e
def test_history_is_the_snapshot_the_metrics_show(agent: Agent) -> None:
    def same_sample() -> tuple[dict, dict] | None:
        history = agent.get("/api/v1/history").json()
        families = scaffold.families(agent.metrics())
        if (
            families["kepler_bridge_last_sample_timestamp_seconds"].samples[0].value
            != history["timestamp"]
        ):
            return None  # a sample was published between the two requests
        return history, families

    history, families = agent.wait_for(same_sample, what="/metrics and the history on one sample")
    power = {s.labels["gpu"]: s.value for s in families["gpu_power_watts"].samples}
    assert history["node"] == "test-node" and history["interval_seconds"] == 0.5
    assert history["window_seconds"] == min(MAX_SECONDS, MAX_SAMPLES * 0.5)
    timestamps = history["timestamps"]
    assert (
        len(timestamps) >= 2
        and timestamps == sorted(timestamps)
        and timestamps[-1] == round(history["timestamp"], 3)
    )
    assert [d["uuid"] for d in history["devices"]] == ["SIM-0000-0000", "SIM-0000-0001"]
    for device in history["devices"]:
        assert set(device["series"]) == {
            "utilization",
            "memory_used_bytes",
            "temperature_celsius",
            "power_watts",
        }
        assert all(len(series) == len(timestamps) for series in device["series"].values())
        assert device["series"]["power_watts"][-1] == pytest.approx(
            power[str(device["gpu"])], abs=1e-3
        )
    assert history["sources"] == [
        {"name": "simulated", "up": True, "state": "up", "error": "", "errors_total": 0}
    ]
    assert [set(pod) for pod in history["pods"]] == [
        {"namespace", "pod", "cpu_joules", "gpu_joules"}
    ]
    assert (
        history["pods"][0]["gpu_joules"] >= 0 and history["pods"][0]["pod"] == ""
    )  # the simulated processes


@pytest.mark.e2e
def test_history_gzip_head_and_methods(agent: Agent) -> None:
    raw = requests.get(
        agent.url + "/api/v1/history", headers={"Accept-Encoding": "gzip"}, stream=True, timeout=5
    )
    assert (
        raw.headers["Content-Encoding"] == "gzip"
        and raw.headers["X-Content-Type-Options"] == "nosniff"
    )
    assert json.loads(gzip.decompress(raw.raw.read()))["node"] == "test-node"
    assert requests.head(agent.url + "/api/v1/history", timeout=5).status_code == 200
    refused = requests.post(agent.url + "/api/v1/history", timeout=5)
    assert refused.status_code == 405 and refused.headers["Allow"] == "GET, HEAD"


def test_history_keeps_at_most_300_samples_or_5_minutes() -> None:
    many = History()
    for k in range(MAX_SAMPLES + 50):
        many.add(snapshot(1000.0 + k * 0.5, interval=0.5))
    assert [s.timestamp for s in many.samples()] == [
        1000.0 + k * 0.5 for k in range(50, MAX_SAMPLES + 50)
    ]
    slow = History()
    for k in range(200):
        slow.add(snapshot(1000.0 + k * 2, interval=2))
    kept = [s.timestamp for s in slow.samples()]
    assert (
        kept[-1] == 1398.0 and kept[0] == 1398.0 - MAX_SECONDS + 2 and len(kept) == MAX_SECONDS / 2
    )


def test_history_of_8_devices_stays_small() -> None:
    snapshots = [snapshot(1000.0 + k) for k in range(MAX_SAMPLES)]
    history = History()
    tracemalloc.start()
    try:
        for item in snapshots:
            history.add(item)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"history of 8 devices x {MAX_SAMPLES} samples: {held} bytes", file=sys.stderr)
    assert held < 160 * 1024
    body = json.loads(history_json(history, snapshots[-1]))
    assert [len(d["series"]["power_watts"]) for d in body["devices"]] == [MAX_SAMPLES] * 8
    assert body["devices"][3]["series"]["power_watts"][-1] == round(
        300.25 + snapshots[-1].timestamp % 7, 3
    )


def test_a_device_that_comes_and_goes_has_gaps() -> None:
    history = History()
    history.add(snapshot(1.0, devices=2))
    history.add(snapshot(2.0, devices=1))
    history.add(snapshot(3.0, devices=2))
    second = json.loads(history_json(history, snapshot(3.0, devices=2)))["devices"][1]["series"]
    assert second["temperature_celsius"] == [41.0, None, 41.0]


def test_two_sources_reporting_one_uuid_keep_two_series() -> None:
    one, other = snapshot(1.0, devices=2).gpus
    twice = Snapshot(
        node="n",
        timestamp=1.0,
        duration_seconds=0.01,
        interval_seconds=1.0,
        gpus=(one, dataclasses.replace(other, index=1, uuid=one.uuid)),
    )
    history = History()
    history.add(twice)
    devices = json.loads(history_json(history, twice))["devices"]
    assert [d["series"]["temperature_celsius"] for d in devices] == [[40.0], [41.0]]


def command_printing(tmp_path: Path, body: object) -> str:
    script = tmp_path / "devices.py"
    script.write_text(f"import json\nprint(json.dumps({body!r}))\n")
    return f"{sys.executable} {script}"


HOSTILE = "<img src=x onerror=\"document.title='pwned'\">'"


@pytest.mark.e2e
def test_hostile_names_and_errors_are_text_not_markup(tmp_path: Path) -> None:
    devices = {
        "devices": [
            {
                "uuid": HOSTILE,
                "vendor": "<b>v</b>",
                "model": "<script>document.title='pwned'</script>",
                "usedMemory": 1,
                "totalMemory": 2,
                "utilization": 0.5,
                "temperature": 40,
                "power": 10,
            },
            {
                "uuid": "down-0",
                "model": "m",
                "up": False,
                "error": "</td><img src=y onerror=alert(1)>",
            },
        ]
    }
    args = (
        "--sources",
        "command,nvml",
        "--command",
        command_printing(tmp_path, devices),
        "--interval",
        "0.5s",
        "--nvml-library",
        f"/nonexistent/{HOSTILE}/libnvidia-ml.so.1",
        "--node-name",
        "<i>node</i>",
    )
    with Agent(*args) as running:
        page = running.get("/").text
        assert (
            html.escape(HOSTILE) in page
            and HOSTILE not in page
            and "&lt;i&gt;node&lt;/i&gt;" in page
        )
        with Browser(tmp_path / "profile") as browser:
            browser.open(running.url + "/")
            browser.wait_for("document.querySelectorAll('#devices article').length === 2")
            text = browser.evaluate("document.body.innerText")
            for literal in (
                HOSTILE,
                "<b>v</b>",
                "<script>document.title='pwned'</script>",
                "</td><img src=y onerror=alert(1)>",
                "<i>node</i>",
            ):
                assert literal in text
            assert (
                browser.evaluate("document.querySelectorAll('img, b:not(#node), i, td > *').length")
                == 0
            )
            assert browser.evaluate("document.scripts.length") == 1
            assert browser.evaluate("document.title") == "kepler-bridge <i>node</i>"
            assert browser.problems == []


@pytest.mark.e2e
def test_token_protects_page_and_history_and_the_page_works_with_it(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with Agent(
        "--simulate", "1", "--sources", "simulated", "--auth-token-file", str(token)
    ) as running:
        for path in ("/", "/api/v1/history"):
            assert running.get(path).status_code == 401
            assert running.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert running.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with Browser(tmp_path / "profile", headers={"Authorization": "Bearer s3cret"}) as browser:
            browser.open(running.url + "/")
            browser.wait_for(charts_drawn(4))
            assert browser.problems == []


CHART_TEXTS = """[...document.querySelectorAll('#devices .metric')].map((m) => ({
  label: m.querySelector('.label').textContent,
  now: m.querySelector('.now').textContent,
  stats: [...m.querySelectorAll('.stats span')].map((s) => s.className + ' ' + s.textContent),
  y: [...m.querySelectorAll('.y span')].map((s) => s.textContent),
  x: [...m.querySelectorAll('.x span')].map((s) => s.textContent),
  limits: m.querySelectorAll('line.limit').length,
}))"""
UNITS = {"utilization": "%", "memory": "B", "temperature": "°C", "power": "W"}
CLOCK = r"\d\d:\d\d:\d\d"
TIP = "document.querySelector('.tip')?.textContent"


def png_width(path: Path) -> int:
    """The width in the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big")


def plot_point(browser: Browser, chart: int, fraction: float) -> tuple[float, float]:
    """Viewport coordinates `fraction` of the way across chart number `chart`, halfway down."""
    box = browser.evaluate(
        f"(() => {{ const r = document.querySelectorAll('.plot')[{chart}]"
        ".getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()"
    )
    return box[0] + box[2] * fraction, box[1] + box[3] / 2


def assert_charts_read_at_a_glance(browser: Browser) -> None:
    """Each chart: its current, min and max value and its axis labels in its unit, clock times
    under it, and a limit line for memory and power."""
    charts = browser.evaluate(CHART_TEXTS)
    assert [c["label"] for c in charts] == list(UNITS) * 2
    for chart in charts:
        unit = re.escape(UNITS[chart["label"]])
        number = rf"-?\d+(\.\d)? ?[KMGT]?i?{unit}"
        assert re.fullmatch(number, chart["now"]), chart
        assert [s.split()[:2] for s in chart["stats"][:2]] == [["min", "min"], ["max", "max"]]
        assert all(re.search(number + "$", s) for s in chart["stats"]), chart
        assert len(chart["y"]) == 3 and all(re.fullmatch(number, y) for y in chart["y"]), chart
        assert len(chart["x"]) == 3 and all(re.fullmatch(CLOCK, x) for x in chart["x"]), chart
        limited = chart["label"] in ("memory", "power")
        assert chart["limits"] == int(limited), chart
        assert (
            any(s.startswith(("limit limit ", "limit total ")) for s in chart["stats"]) == limited
        )


@pytest.mark.e2e
def test_charts_read_at_a_glance_from_a_phone_to_a_wide_screen(
    agent: Agent, tmp_path: Path
) -> None:
    with Browser(tmp_path / "profile") as browser:
        browser.open(agent.url + "/")
        browser.wait_for(charts_drawn(8))
        for width, height, phone in ((360, 740, True), (1440, 900, False), (1920, 1080, False)):
            browser.resize(width, height, mobile=phone)
            browser.wait_for(f"innerWidth === {width}")
            page = "document.documentElement"  # which never scrolls sideways
            assert browser.evaluate(f"{page}.scrollWidth <= {page}.clientWidth"), width
            assert browser.layout_problems() == [], width
            assert_charts_read_at_a_glance(browser)
            shot = tmp_path / f"live-{width}.png"
            browser.screenshot(shot)
            assert png_width(shot) == width and shot.stat().st_size > 10_000
            columns = browser.evaluate(
                "new Set([...document.querySelectorAll('#devices article')]"
                ".map((a) => a.getBoundingClientRect().left)).size"
            )
            assert columns == (1 if phone else 2)  # one card a row on a phone, side by side wide
        browser.point(*plot_point(browser, 3, 0.99))  # gpu 0's power
        tip = browser.wait_for(TIP)
        assert re.fullmatch(rf"\d+ W at {CLOCK}", tip), tip
        assert browser.evaluate("document.querySelectorAll('.tip, .dot, line.mark').length") == 3
        # A redraw keeps the tip, now on the newest sample under the pointer.
        browser.wait_for(f"{TIP} !== {json.dumps(tip)}")
        browser.resize(360, 740, mobile=True)
        browser.wait_for("innerWidth === 360")
        browser.tap(*plot_point(browser, 0, 0.99))  # gpu 0's utilization, by touch
        browser.wait_for(f"{TIP}.includes('%')")
        assert browser.evaluate("document.querySelectorAll('.tip').length") == 1
        assert re.fullmatch(rf"\d+ % at {CLOCK}", browser.evaluate(TIP)), browser.evaluate(TIP)
        browser.tap(10, 10)  # elsewhere
        browser.wait_for("document.querySelectorAll('.tip, .dot, line.mark').length === 0")
        # The layout probe sees a text laid over another and a word broken in two.
        browser.evaluate(
            "(() => { const p = document.createElement('p'); p.textContent = 'over lapping';"
            " p.style = 'position:absolute;top:0;left:0;margin:12px 16px;width:4ch;"
            "overflow-wrap:anywhere;font:20px monospace'; document.body.append(p); })()"
        )
        found = browser.layout_problems()
        assert "overlap: kepler-bridge  | over lapping" in found, found
        assert "word wraps: lapping" in found and "word wraps: over" not in found, found
        assert browser.problems == []


BADGES = (
    "[...document.querySelectorAll('#devices article')]"
    ".map((a) => [...a.querySelectorAll('.badge')].map((b) => b.textContent))"
)


@pytest.mark.e2e
def test_cards_show_a_down_a_throttled_gpu_a_recent_xid_and_an_anomaly(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    fake_nvml.gpu(0, clocks_event_reasons=0x1 | 0x4 | 0x40)  # idle, power cap, hw thermal
    args = ("--sources", "nvml", "--nvml-library", str(fake_nvml.library), "--interval", "0.5s")
    with Agent(*args, env=fake_nvml.env()) as running:
        fake_nvml.add_xid(0, 79)
        with Browser(tmp_path / "profile") as browser:
            browser.resize(360, 740, mobile=True)
            browser.open(running.url + "/")
            browser.wait_for(charts_drawn(8))
            fake_nvml.gpu(1, lost=True)
            badges = browser.wait_for(
                f"(() => {{ const b = {BADGES}; return b[1].length && b[0].length > 1 && b; }})()"
            )
            assert badges[0][0] == "throttled: sw power cap, hw thermal slowdown"
            assert re.fullmatch(rf"XID 79 at {CLOCK}", badges[0][1]) and badges[1] == ["down"]
            assert browser.evaluate("document.querySelectorAll('article.off').length") == 1
            assert browser.layout_problems() == []
            browser.screenshot(tmp_path / "faults-360.png")
            assert png_width(tmp_path / "faults-360.png") == 360
            quiet = (
                "{up: true, throttled: ['gpu_idle'], last_xid_timestamp: 1000, last_xid_code: 1}"
            )
            assert browser.evaluate(f"badges({quiet}, 1000 + 3601).children.length") == 0
            odd = "{up: true, anomalies: ['memory_leak', 'frozen_sensor']}"
            assert browser.evaluate(f"badges({odd}, 0).textContent") == (
                "anomaly: memory leak, frozen sensor"
            )
            assert browser.problems == []
        device = running.get("/api/v1/history").json()["devices"][0]
        assert device["throttled"] == ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]
        assert device["last_xid_code"] == 79 and device["last_xid_timestamp"] > 0
