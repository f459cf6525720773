"""Debian's chromium, headless, driven by selenium through its chromedriver: the dashboard's pages in a real
browser (scripts/test installs both)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def browser(tmp_path: Path):  # noqa: ANN201 (selenium's driver)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1500", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def wait_for(condition, timeout: float, what: str):  # noqa: ANN001, ANN201
    """Poll `condition` until it returns something true (its value); fail naming `what` after `timeout`, which is a
    ceiling for a stuck run, not a measure of speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"the dashboard never showed {what} within {timeout:.0f} s")


def progress_line(run: Path, tmp_path: Path, marker: str) -> str:
    """The dashboard's progress line for the run folder `run`, as a real browser shows it, once it holds `marker`
    (the caller skips where chromium is missing)."""
    from coordinator.dashboard import Dashboard

    dashboard = Dashboard(run, "127.0.0.1", 0).start()
    driver = browser(tmp_path)
    try:
        driver.get(dashboard.url + "?refresh=200")
        return wait_for(lambda: marker in (t := driver.find_element("id", "progress-text").text) and t, 60, marker)
    finally:
        driver.quit()
        dashboard.stop()
