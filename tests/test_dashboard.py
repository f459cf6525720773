"""The live dashboard (coordinator/dashboard/): what it serves and to whom, and, in Debian's chromium driven by
selenium, the page of a running 10-device fleet (every device, the round advancing) and of the finished run (the
accuracy matrix). The browser test saves screenshots under runs/test-screenshots/ for a person to look at."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from browser import CHROMEDRIVER, CHROMIUM, browser, wait_for
from fleet_harness import default_signals

from coordinator.broker import mosquitto_path
from coordinator.dashboard import Dashboard, run_view
from coordinator.preparation import Preparation
from edgefil.logs import OWN_PACKAGES
from models.export import export_registered

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "runs" / "test-screenshots"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")

FLEET = """
name = "watched"
out = "run"
devices = 10
workers = 2
real_time = true                  # each round lasts its emulated devices' time, however fast this host: the page
                                  # sees the rounds advance without racing them
broker = "{broker}"
scenario = {{preset = "digits-class", n_tasks = 2}}
profiles = {{raspberry-pi-4-4gb = 4, raspberry-pi-zero-2w = 2, jetson-nano = 2, jetson-orin-nano = 2}}
[policy]
name = "refed"
[store]
max_samples = 40                  # binds from the second task: Re-Fed runs its PIM and reports it
[client]
epochs = 10
[coordinator]
rounds_per_task = 2
min_clients = 5
deadline_s = 60.0
"""


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_a_dashboard_serves_the_run_folders_newest_record_and_nothing_else(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"fleet": "f", "outcome": "complete", "history": []}))
    dashboard = Dashboard(tmp_path, "127.0.0.1", 0).start()
    try:
        base = dashboard.url
        status, body = get(base + "api/run")
        assert status == 200 and json.loads(body)["run"]["outcome"] == "complete"
        (tmp_path / "live.json").write_text('{"fleet": "f", "outcome": "running", "loss": NaN}')
        status, body = get(base + "api/run")
        view = json.loads(body)  # strict JSON: the NaN a browser could not parse is null
        assert view["run"]["outcome"] == "running" and view["run"]["loss"] is None
        status, page = get(base)
        assert status == 200 and b"dashboard.js" in page
        assert get(base + "static/uPlot.iife.min.js")[0] == 200
        for path in ("static/../../results.json", "static/fleet.json", "etc/passwd", "static/"):
            assert get(base + path)[0] == 404, path
    finally:
        dashboard.stop()


def test_before_the_first_round_the_page_gets_the_preparations_step(tmp_path):
    """A fleet's preparation (coordinator/preparation.py): each step as it starts, the exporter's own among them;
    the page gets the step under way until the run has a record of its own."""
    preparing = Preparation(tmp_path)
    preparing.step("building the scenario")
    export_registered("mlp", 3, tmp_path / "artifacts", (1, 4, 4), backends=("portable",), graphs=(),
                      progress=preparing.step)
    view = run_view(tmp_path)
    assert view["run"] is None and view["preparing"]["step"].startswith("exporting mlp for the portable backend")
    assert [d["step"] for d in view["preparing"]["done"]] == ["building the scenario"]
    (tmp_path / "live.json").write_text(json.dumps({"fleet": "f", "outcome": "running"}))
    assert run_view(tmp_path)["preparing"] is None


def test_the_preparations_first_step_makes_its_folder_and_a_failed_write_does_not_silence_the_next(tmp_path, caplog):
    """A fleet's first step (checking its file) comes before its run folder exists; a step that cannot be written
    (here the folder's path is taken by a file) is logged once, and the next step is written once it can be."""
    Preparation(tmp_path / "run" / "new").step("checking the fleet file")
    assert run_view(tmp_path / "run" / "new")["preparing"]["step"] == "checking the fleet file"
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    preparing = Preparation(blocked)
    with caplog.at_level(logging.WARNING, logger="edgefil.fleet"):
        preparing.step("checking the fleet file")
        preparing.step("writing every client's share")
    assert len([r for r in caplog.records if "not written" in r.getMessage()]) == 1
    blocked.unlink()
    preparing.step("exporting the model")
    view = run_view(blocked)["preparing"]
    assert view["step"] == "exporting the model"
    assert [d["step"] for d in view["done"]] == ["checking the fleet file", "writing every client's share"]


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="Debian's chromium and chromium-driver are not installed (scripts/test installs them)")
def test_the_browser_shows_the_step_a_fleet_prepares_before_its_first_round(tmp_path):
    Preparation(tmp_path).step("exporting lenet for the portable backend")
    dashboard = Dashboard(tmp_path, "127.0.0.1", 0).start()
    driver = None
    try:
        driver = browser(tmp_path)
        driver.get(dashboard.url + "?refresh=200")
        shown = wait_for(lambda: (t := driver.find_element("id", "outcome").text).startswith("preparing") and t, 60,
                         "the preparation's step")
        assert shown.startswith("preparing: exporting lenet for the portable backend (")
    finally:
        if driver is not None:
            driver.quit()
        dashboard.stop()


def test_off_loopback_the_dashboard_needs_its_token(tmp_path):
    assert Dashboard(tmp_path, "127.0.0.1", 0).token is None  # loopback: no token unless asked for
    dashboard = Dashboard(tmp_path, "127.0.0.1", 0, token="s3cret").start()  # as bound elsewhere
    try:
        plain = dashboard.url.split("?")[0]
        assert dashboard.url.endswith("?token=s3cret")
        assert get(plain)[0] == 403 and get(plain + "api/run")[0] == 403
        assert get(plain + "api/run?token=wrong")[0] == 403
        assert get(plain + "api/run?token=s3cret")[0] == 200
        assert get(plain + "api/run", token="s3cret")[0] == 200
    finally:
        dashboard.stop()


def test_without_a_token_only_a_loopback_host_header_is_served(tmp_path):
    """DNS rebinding: a page elsewhere that makes its own name resolve to 127.0.0.1 sends its name as the Host."""
    dashboard = Dashboard(tmp_path, "127.0.0.1", 0).start()
    try:
        port = dashboard.server.server_address[1]
        for host, status in ((f"evil.example:{port}", 403), ("evil.example", 403), (f"localhost:{port}", 200),
                             (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200)):
            request = urllib.request.Request(dashboard.url + "api/run", headers={"Host": host})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    got, body = response.status, response.read()
            except urllib.error.HTTPError as err:
                got, body = err.code, err.read()
            assert got == status, (host, body)
        assert b"the Host header names no loopback address" in get_with_host(dashboard.url, "evil.example")
    finally:
        dashboard.stop()


def get_with_host(url: str, host: str) -> bytes:
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Host": host}), timeout=10)
    except urllib.error.HTTPError as err:
        return err.read()
    return b""


def test_idle_connections_are_bounded_and_closed(tmp_path):
    """Clients that connect and send nothing hold at most `max_connections` threads (one more is closed at once),
    each idle one is closed after `idle_timeout_s`, and then the page answers again."""
    import socket

    dashboard = Dashboard(tmp_path, "127.0.0.1", 0, max_connections=4, idle_timeout_s=1.0).start()
    threads_before = threading.active_count()
    most, done = [0], threading.Event()

    def count_threads() -> None:
        while not done.is_set():
            most[0] = max(most[0], threading.active_count() - 1)  # less this one
            time.sleep(0.01)

    counter = threading.Thread(target=count_threads, daemon=True)
    counter.start()
    idle = [socket.create_connection(dashboard.server.server_address[:2], timeout=60) for _ in range(12)]
    try:
        for sock in idle:  # refused at once, or closed once idle past the timeout: the server ends every one
            assert sock.recv(1) == b""
        done.set()
        counter.join()
        assert most[0] <= threads_before + 4 and dashboard.server.refused >= 1, (most, dashboard.server.refused)
        assert get(dashboard.url + "api/run")[0] == 200
    finally:
        done.set()
        for sock in idle:
            sock.close()
        dashboard.stop()


def test_a_client_that_hangs_up_costs_one_line_not_a_traceback(tmp_path, caplog, capfd):
    import logging
    import socket
    import struct

    caplog.set_level(logging.DEBUG, logger="edgefil.dashboard")
    dashboard = Dashboard(tmp_path, "127.0.0.1", 0).start()
    try:
        sock = socket.create_connection(dashboard.server.server_address[:2], timeout=10)
        sock.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the headers never end
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, mid-request
        wait_for(lambda: "dashboard client 127.0.0.1: ConnectionResetError" in caplog.text, 60, "the hang-up logged")
        assert "Traceback" not in capfd.readouterr().err
        assert get(dashboard.url + "api/run")[0] == 200
    finally:
        dashboard.stop()


def test_a_dashboard_that_cannot_listen_leaves_the_run_alone(tmp_path, caplog):
    from coordinator.dashboard import start_dashboard

    first = Dashboard(tmp_path, "127.0.0.1", 0)
    try:
        taken = first.server.server_address[1]
        assert start_dashboard(tmp_path, f"127.0.0.1:{taken}") is None
        assert "the run goes on without it" in caplog.text
    finally:
        first.server.server_close()


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="Debian's chromium and chromium-driver are not installed (scripts/test installs them)")
def test_the_browser_shows_a_running_fleets_devices_and_rounds_and_the_finished_runs_matrix(tmp_path):
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET.format(broker="auto" if mosquitto_path() else "embedded"))
    log = tmp_path / "fleet.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgefil.cli", "fleet", "run", str(fleet_file), "--dashboard", "127.0.0.1:0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    driver = None
    try:
        url = wait_for(lambda: next((line.split("dashboard: ")[1].strip() for line in list(lines)
                                     if "dashboard: http" in line), None), 120, "its address (the fleet's log)")
        driver = browser(tmp_path)
        driver.get(url + "?refresh=200")

        # read in one script each: the page redraws its tables every refresh, so elements found earlier go stale
        def devices() -> list[list[str]]:
            return driver.execute_script(
                "return [...document.querySelectorAll('#devices tbody tr')]"
                ".map(r => [...r.querySelectorAll('td')].map(c => c.textContent));")

        def progress() -> tuple[int, int, str]:
            done, total, outcome = driver.execute_script(
                "const p = document.getElementById('progress-text');"
                "return [p.dataset.done || 0, p.dataset.total || 0, document.getElementById('outcome').textContent];")
            return int(done), int(total), outcome

        shown = wait_for(lambda: (d := devices()) and len(d) == 10 and all(r[3] == "online" for r in d) and d,
                         180, "ten devices online")
        assert [r[0] for r in shown] == [f"dev-{i:03d}" for i in range(10)]
        assert {r[1] for r in shown} == {"raspberry-pi-4-4gb", "raspberry-pi-zero-2w", "jetson-nano",
                                         "jetson-orin-nano"}
        seen_while_running = set()

        def advanced() -> bool:
            done, total, outcome = progress()
            if outcome == "running":
                seen_while_running.add(done)
            return len(seen_while_running - {0}) >= 2 or outcome != "running"

        wait_for(advanced, 300, "the rounds advance")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / "dashboard-running.png"))
        assert len(seen_while_running - {0}) >= 2, f"the page went from {sorted(seen_while_running)} to the end"
        assert proc.wait(timeout=300) == 0, "".join(lines[-30:])
        wait_for(lambda: progress()[2] == "complete", 30, "the run complete")
        done, total, _ = progress()
        assert done == total == 4
        results = json.loads((tmp_path / "run" / "results.json").read_text())
        expected = [f"{100 * a:.1f}" for row in results["accuracy_matrix"] for a in row]
        shown_matrix = wait_for(lambda: driver.execute_script(
            "return [...document.querySelectorAll('#matrix td')].map(c => c.textContent).filter(t => t);"),
            30, "the accuracy matrix")
        assert shown_matrix == expected and len(expected) == 3
        # Re-Fed's devices report their PIM runs: the method's panel draws each round's mean over the devices, which
        # live.json gives as device_means, results.json (every device's metrics) holds whole
        assert driver.execute_script("return document.getElementById('method-none').hidden") is True
        names, *series = driver.execute_script(
            "const m = charts.method; return [m.plot.series.slice(1).map(s => s.label), ...m.plot.data.slice(1)];")
        drift = names.index("devices' mean: pim_drift")
        reported = [[m["pim_drift"] for m in entry["metrics"].values() if "pim_drift" in m]
                    for entry in results["history"]]
        assert any(reported) and series[drift] == [
            pytest.approx(sum(r) / len(r)) if r else None for r in reported]
        driver.save_screenshot(str(SCREENSHOTS / "dashboard-finished.png"))
        assert (SCREENSHOTS / "dashboard-finished.png").stat().st_size > 10_000
        # the command's console: its own log lines only (an export logged hundreds of onnxscript INFO lines)
        logged = [line.split()[2] for line in lines if LOG_LINE.match(line)]
        assert logged and all(name.split(".")[0] in OWN_PACKAGES for name in logged), sorted(set(logged))
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:  # SIGTERM stops a fleet cleanly (its device disks unmounted); SIGKILL if it hangs
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.write_text("".join(lines))
