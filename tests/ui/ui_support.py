"""Helpers of the viewer's tests: the viewer served over real HTTP on loopback, a headless
Chromium (Debian's ``chromium`` and ``chromium-driver`` through Selenium), screenshots."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

ARTIFACTS = Path(os.environ.get("CLOSEDLOOP_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "out" / "test-artifacts")) / "ui"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedUI:
    """The viewer's app under uvicorn on a thread, on a free loopback port; ``url`` once it listens."""

    def __init__(self, **settings) -> None:
        import uvicorn

        from closedloop.ui.app import UISettings, create_app

        self.app = create_app(UISettings(**settings))
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServedUI":
        import time

        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:  # uvicorn sets it once the socket listens
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the viewer did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no system Chromium: `apt-get install chromium chromium-driver` (.ci/run does) runs the browser tests")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
                "--disable-extensions", "--no-first-run", "--disable-background-networking"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


def shot(browser, name: str) -> Path:
    """A full-page PNG of the current page into the test artifacts."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return Math.min(document.body.scrollHeight, 4000)")
    browser.set_window_size(1280, max(600, int(height) + 40))
    path = ARTIFACTS / f"{name}.png"
    browser.save_screenshot(str(path))
    browser.set_window_size(1280, 900)
    return path
