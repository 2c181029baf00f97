"""Debian's headless chromium, driven over the DevTools protocol (websocket-client):
load a page with request headers, evaluate script in it (and wait for it to hold),
take a screenshot."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from r3store.testing.service import free_port


class Browser:
    def __init__(self, profile: Path) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            raise RuntimeError("chromium is not installed (apt-get install chromium)")
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # the tests may run as root
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--remote-debugging-port={self.port}",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._ids = itertools.count(1)
        try:  # no Origin header: chromium refuses other origins than its own
            self._ws = websocket.create_connection(
                self._page_socket(), timeout=30, suppress_origin=True
            )
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise

    def _page_socket(self) -> str:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json") as answer:
                    targets = json.load(answer)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.2)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def open(self, url: str, headers: dict[str, str]) -> None:
        """Load `url` sending `headers` with every request, and wait until it loaded."""
        self.call("Network.enable")
        self.call("Network.setExtraHTTPHeaders", headers=headers)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not finish loading")
            time.sleep(0.1)

    def wait_for(self, script: str, timeout: float = 30) -> Any:
        """Evaluate `script` until it returns something truthy (after a navigation the
        page's context changes: a failing evaluation is tried again)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(script)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"{script!r} stayed false")
            time.sleep(0.1)

    def evaluate(self, script: str) -> Any:
        result = self.call("Runtime.evaluate", expression=script, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(
            self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data

    def close(self) -> None:
        try:
            self._ws.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
