"""Debian's headless Chromium driven over the DevTools protocol on a pipe.

Over --remote-debugging-pipe, so that no extra package is needed.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

# Each visible text node's client rects, per node and per word: words that wrap inside themselves
# and pairs of texts whose rects overlap (by more than a pixel).
LAYOUT_PROBLEMS = """(() => {
  const texts = [], problems = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const rects = (range) => [...range.getClientRects()].filter((r) => r.width > 0 && r.height > 0);
  for (let node; (node = walk.nextNode()); ) {
    const range = document.createRange();
    range.selectNodeContents(node);
    if (node.data.trim() && rects(range).length) texts.push([node.data, rects(range)]);
    for (const word of node.data.matchAll(/\\S+/g)) {
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      const lines = new Set(rects(range).map((r) => Math.round(r.top))).size;
      if (lines > 1) problems.push("word wraps: " + word[0]);
    }
  }
  const apart = (a, b) => a.right - 1 <= b.left || a.bottom - 1 <= b.top;
  const over = (a, b) => !apart(a, b) && !apart(b, a);
  texts.forEach(([text, boxes], i) => texts.slice(i + 1).forEach(([other, others]) => {
    if (boxes.some((a) => others.some((b) => over(a, b)))) {
      problems.push("overlap: " + text + " | " + other);
    }
  }));
  return problems;
})()"""


def chromium() -> str:
    """Path of Debian's chromium; fails the test (never skips) when it is missing."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is missing: `make deps-test` installs it (apt-get install chromium)")
    return path


class Browser:
    """One page in a headless Chromium.

    `problems` collects console errors, exceptions and failed requests."""

    def __init__(self, profile: Path, headers: dict[str, str] | None = None) -> None:
        commands, self._commands = os.pipe()
        self._replies, replies = os.pipe()

        def on_fds_3_and_4() -> None:  # the protocol's pipe: Chromium reads fd 3 and writes fd 4
            read, write = (
                fcntl.fcntl(commands, fcntl.F_DUPFD, 10),
                fcntl.fcntl(replies, fcntl.F_DUPFD, 10),
            )
            os.dup2(read, 3)
            os.dup2(write, 4)

        args = [
            chromium(),
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-extensions",
            "--window-size=1280,900",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to start as root with its sandbox
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            args,
            preexec_fn=on_fds_3_and_4,
            close_fds=False,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        os.close(commands)
        os.close(replies)
        self._buffer = b""
        self._last_id = 0
        self._session = ""
        self._urls: dict[str, str] = {}
        self.requests: list[str] = []
        self.problems: list[str] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(domain + ".enable")
        self.resize(1280, 900)
        if headers:
            self.call("Network.setExtraHTTPHeaders", headers=headers)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, timeout: float = 10.0, **params: Any) -> dict:
        """Send one protocol command and return its result, noting the events meanwhile."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline, method)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._note(reply)

    def open(self, url: str, timeout: float = 10.0) -> None:
        """Navigate and wait for the load event."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while (event := self._receive(deadline, "Page.loadEventFired")).get(
            "method"
        ) != "Page.loadEventFired":
            self._note(event)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page; raises on a JavaScript exception."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0) -> Any:
        """Evaluate until the value is truthy and return it; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{expression!r} still {value!r} after {timeout}s; problems: {self.problems}"
                )
            time.sleep(0.1)
        return value

    def resize(self, width: int, height: int, mobile: bool = False) -> None:
        """Lay the page out in a viewport of this size; `mobile`: as a phone, with touch."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=mobile,
        )
        self.call("Emulation.setTouchEmulationEnabled", enabled=mobile)

    def point(self, x: float, y: float) -> None:
        """Move the mouse to (x, y) in CSS pixels of the viewport."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def tap(self, x: float, y: float) -> None:
        """Touch (x, y) with one finger and lift it."""
        self.call("Input.dispatchTouchEvent", type="touchStart", touchPoints=[{"x": x, "y": y}])
        self.call("Input.dispatchTouchEvent", type="touchEnd", touchPoints=[])

    def layout_problems(self) -> list[str]:
        """Visible texts that overlap another text, and words that wrap inside themselves."""
        return self.evaluate(LAYOUT_PROBLEMS)

    def screenshot(self, path: Path) -> None:
        """The viewport as a PNG file."""
        path.write_bytes(
            base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        )

    def close(self) -> None:
        """Quit Chromium (kill it when it does not quit within 5 s) and close the pipe."""
        try:
            self._session = ""
            self.call("Browser.close", timeout=5)
        except (RuntimeError, OSError, AssertionError):
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)
        self.log.close()

    def _receive(self, deadline: float, waiting_for: str) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select(
                [self._replies], [], [], max(0.0, deadline - time.monotonic())
            )
            chunk = os.read(self._replies, 1 << 20) if ready else b""
            if not chunk:
                self.log.seek(0)
                raise AssertionError(
                    f"no answer from Chromium to {waiting_for}; its log:\n"
                    f"{self.log.read()[-3000:].decode(errors='replace')}"
                )
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _note(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            self._urls[params["requestId"]] = params["request"]["url"]
            self.requests.append(params["request"]["url"])
        elif method == "Network.loadingFailed":
            self.problems.append(
                f"request failed: {self._urls.get(params['requestId'])}: {params['errorText']}"
            )
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            self.problems.append(
                f"HTTP {params['response']['status']}: {params['response']['url']}"
            )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.problems.append(
                f"exception: {details.get('exception', {}).get('description', details['text'])}"
            )
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.problems.append(
                f"console.{params['type']}: {[arg.get('value') for arg in params['args']]}"
            )
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.problems.append(f"log: {params['entry']['text']} {params['entry'].get('url', '')}")
