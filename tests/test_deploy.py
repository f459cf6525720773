"""Deployment: the systemd unit `edgefil client install` writes (checked by `systemd-analyze verify` where systemd
is present) and the private file beside it; the daemon's notifications to systemd; a device whose broker is not up
yet waits for it instead of exiting; the container files name what exists and build where a container engine
answers."""
from __future__ import annotations

import ctypes.util
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from external_device import run_rounds

from coordinator.broker import Credentials, MosquittoBroker, free_port, mosquitto_path
from edge_client.config import DeviceConfig
from edge_client.systemd import notify

ROOT = Path(__file__).resolve().parents[1]
DEVICE = """
device_id = "pi-1"
fleet = "lab"
artifacts = "../artifacts"
state_dir = "../state/pi-1"
[broker]
host = "127.0.0.1"
port = 8883
password = "a-device-password-1"
cafile = "../broker/ca.crt"
[data]
folder = "../data/devices/pi-1"
"""


def test_client_install_writes_a_unit_systemd_accepts_and_a_private_absolute_config(tmp_path):
    folder = tmp_path / "lab" / "devices"
    folder.mkdir(parents=True)
    (folder / "pi-1.toml").write_text(DEVICE)
    root = tmp_path / "root"
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "client", "install", "--config",
                           str(folder / "pi-1.toml"), "--root", str(root), "--watchdog-s", "900"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    unit = root / "etc/systemd/system/edgefil-pi-1.service"
    installed = root / "etc/edgefil/pi-1.toml"
    assert "systemctl daemon-reload && systemctl enable --now edgefil-pi-1.service" in done.stdout
    text = unit.read_text()
    for line in ("Type=notify", "Restart=always", "RestartPreventExitStatus=2", "WatchdogSec=900", "StateDirectory=edgefil/pi-1", "User=edgefil",
                 "ExecStart=", " client --config /etc/edgefil/pi-1.toml", "NoNewPrivileges=yes"):
        assert line in text, line
    executable = re.search(r"ExecStart=(\S+)", text).group(1)
    assert Path(executable).is_absolute() and os.access(executable, os.X_OK)
    assert installed.stat().st_mode & 0o777 == 0o600  # it holds the broker password
    config = DeviceConfig.load(installed)
    lab = (tmp_path / "lab").resolve()
    assert config.state_dir == Path("/var/lib/edgefil/pi-1") and config.on_end == "wait"
    assert config.artifacts == lab / "artifacts" and config.data.folder == lab / "data/devices/pi-1"
    assert config.broker.cafile == lab / "broker/ca.crt" and config.broker.password == "a-device-password-1"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit was not verified")
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    problems = [line for line in (verified.stdout + verified.stderr).splitlines()
                if "edgefil-pi-1.service" in line]
    assert verified.returncode == 0 and problems == [], verified.stdout + verified.stderr


@pytest.mark.skipif("nobody" not in {entry.pw_name for entry in pwd.getpwall()}, reason="no user 'nobody' here")
def test_install_refuses_a_lab_its_service_user_cannot_read_and_installs_it_where_it_can(tmp_path):
    """A Raspberry Pi's home folder is 0700: a lab copied there is out of the service user's reach, and its daemon
    would say only that the folder holds no model. The install says why in one line, naming the folder; the lab
    copied where the user can read it (docs/deploy.md, step 3) installs."""
    lab = tmp_path / "home" / "lab"
    for folder in ("devices", "artifacts", "broker", "data/devices/pi-1"):
        (lab / folder).mkdir(parents=True)
    (lab / "devices" / "pi-1.toml").write_text(DEVICE)
    (lab / "artifacts" / "manifest.json").write_text("{}")
    (lab / "broker" / "ca.crt").write_text("a certificate")
    (tmp_path / "home").chmod(0o700)

    def install(config: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgefil.cli", "client", "install", "--config", str(config),
                               "--root", str(tmp_path / "root"), "--user", "nobody"],
                              capture_output=True, text=True, timeout=60)

    refused = install(lab / "devices" / "pi-1.toml")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"artifacts: the service user nobody cannot read {lab / 'artifacts'}: " in refused.stderr
    assert "is drwx------" in refused.stderr and "docs/deploy.md" in refused.stderr
    srv = Path(tempfile.mkdtemp(prefix="edgefil-srv-", dir="/tmp"))  # outside any private folder, as /srv is
    try:
        srv.chmod(0o755)
        shutil.copytree(lab, srv / "lab")
        done = install(srv / "lab" / "devices" / "pi-1.toml")
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(srv)


def sandbox_unit(tmp_path: Path) -> Path:
    from edge_client.systemd import install

    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "pi-1.toml").write_text(DEVICE)
    return install(tmp_path / "lab" / "pi-1.toml", tmp_path / "root")[0]


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_the_units_sandbox_scores_3_or_less_and_a_device_trains_a_round_inside_it(tmp_path, export_artifacts,
                                                                                caplog):
    """The exposure `systemd-analyze security` gives the unit (8.6 before the sandbox), and a device daemon training
    a round under the unit's system call filter, address families and dropped capabilities (tests/unit_sandbox.py
    applies them from the unit's lines; the mount-namespace options need systemd as init)."""
    if shutil.which("systemd-analyze") is None or ctypes.util.find_library("seccomp") is None:
        pytest.skip("systemd-analyze or libseccomp is not installed: the sandbox was not checked")
    unit = sandbox_unit(tmp_path)
    scored = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=30", "--no-pager",
                             str(unit)], capture_output=True, text=True, timeout=60)
    exposure = re.search(r"Overall exposure level for edgefil-pi-1.service: ([0-9.]+)", scored.stdout)
    assert scored.returncode == 0 and exposure and float(exposure.group(1)) <= 3.0, scored.stdout + scored.stderr
    sandbox = [sys.executable, str(ROOT / "tests" / "unit_sandbox.py"), str(unit), "--"]
    packet = subprocess.run([*sandbox, sys.executable, "-c", "import socket; socket.socket(socket.AF_PACKET, "
                             "socket.SOCK_RAW)"], capture_output=True, text=True, timeout=60)
    assert packet.returncode != 0 and "Operation not permitted" in packet.stderr, packet.stderr  # the filter holds
    results, output = run_rounds([*sandbox, sys.executable], export_artifacts("lenet", 10, (1, 8, 8)), tmp_path,
                                 caplog, rounds=1, samples=200, deadline_s=600.0)
    assert results["rounds_completed"] == 1 and "pi-0" in results["history"][0]["received"], output


def test_a_broken_device_file_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "d.toml").write_text(DEVICE.replace("port = 8883", "port = 70000"))
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", "client", "install", "--config",
                           str(tmp_path / "d.toml"), "--root", str(tmp_path / "root")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "port must be in 1..65535" in done.stderr and not (tmp_path / "root").exists()


def notify_socket(tmp_path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(60)
    return listener


def test_notify_speaks_to_systemds_socket_and_is_silent_without_one(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    listener = notify_socket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    assert notify("WATCHDOG=1") is True
    assert listener.recv(64) == b"WATCHDOG=1"
    listener.close()


@pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed (scripts/test installs it)")
def test_a_device_waits_for_a_broker_that_comes_up_late_and_then_says_it_is_ready(tmp_path, export_artifacts,
                                                                                  monkeypatch, caplog):
    from edge_client.device import Device, run_device

    port = free_port()
    config = DeviceConfig.from_dict({
        "device_id": "pi-1", "fleet": "lab", "artifacts": str(export_artifacts("lenet", 10, (1, 8, 8))),
        "state_dir": str(tmp_path / "state"), "broker": {"port": port, "password": "a-device-password-1"},
        "data": {"folder": str(tmp_path)},
    })
    listener = notify_socket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    built: list[Device] = []
    monkeypatch.setattr("signal.signal", lambda *args: None)  # run_device's handlers are the main thread's

    def run() -> None:
        built.append(Device(config))
        run_device(built[0], connect_timeout=0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert listener.recv(64) == b"WATCHDOG=1"  # waiting for its broker, and alive
    assert thread.is_alive()
    broker = MosquittoBroker(tmp_path / "broker", "lab", {"pi-1": "a-device-password-1"},
                             Credentials("coordinator", "coordinator-password"), port=port)
    broker.start()
    try:
        deadline = time.monotonic() + 60
        while listener.recv(64) != b"READY=1":
            assert time.monotonic() < deadline
        assert "still trying" in caplog.text
        built[0].stop_requested.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        broker.stop()
        listener.close()


CONTAINER_FILES = sorted((ROOT / "deploy").glob("*.Containerfile"))


def test_every_container_file_copies_what_exists_and_installs_the_right_extra():
    assert {p.name for p in CONTAINER_FILES} == {"coordinator.Containerfile", "device.Containerfile",
                                                  "jetson.Containerfile"}
    for path in CONTAINER_FILES:
        text = path.read_text()
        for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
            for name in source.split():
                assert (ROOT / name).exists(), f"{path.name}: COPY {name}: no such path"
        installs = re.findall(r"pip install [^&\n]*", text)
        assert len(installs) == 1, path.name
        wants_host = path.name == "coordinator.Containerfile"
        assert ("'.[host]'" in installs[0]) == wants_host and installs[0].rstrip().endswith(
            "'.[host]'" if wants_host else " ."), installs[0]
        assert "USER edgefil" in text and 'ENTRYPOINT ["edgefil"]' in text


BASE = "localhost/edgefil-base:bookworm"
# Where a host's kernel lets a container raise no limit (no CAP_SYS_RESOURCE, as in this project's sandboxed
# machines) and crun refuses its cgroups (v1 with a v2 hierarchy beside it), podman runs containers with runc and
# limits no higher than the host's: tried only when a plain run fails.
CONSTRAINED = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def _container_engine() -> str | None:
    for tool in ("docker", "podman"):
        if shutil.which(tool) and subprocess.run([tool, "info"], capture_output=True, timeout=30).returncode == 0:
            return tool
    return None


def _engine_flags(tool: str) -> list[str] | None:
    """What `tool run` and `tool build` need on this host to start a container of the local base: none, the
    constrained flags, or None when neither starts one."""
    if subprocess.run([tool, "image", "exists", BASE] if tool == "podman" else [tool, "image", "inspect", BASE],
                      capture_output=True).returncode != 0:
        subprocess.run([str(ROOT / "deploy" / "base-image"), tool], check=True, capture_output=True, timeout=900)
    for flags in ([], CONSTRAINED if tool == "podman" else None):
        if flags is not None and subprocess.run([tool, "run", "--rm", *flags, BASE, "true"],
                                                capture_output=True, timeout=120).returncode == 0:
            return flags
    return None


@pytest.mark.slow
@pytest.mark.skipif(_container_engine() is None or shutil.which("mmdebstrap") is None or mosquitto_path() is None,
                    reason="no container engine answers here (tried docker info and podman info), or no mmdebstrap "
                           "to make the base image without a registry, or no mosquitto")
def test_the_images_build_on_a_local_base_and_a_device_container_trains_against_a_coordinator_container(tmp_path):
    """deploy/base-image makes the base from Debian's packages (no registry pull), the device and coordinator images
    build on it, and the README's first federation runs with both in containers as docs/deploy.md runs them: the
    operator's own uid (the files `edgefil init` writes are 0600, the operator's), the lab read-only for the device,
    its state on a writable volume (`--state-dir`); where the tests run as root, the lab is handed to a user who is
    not. Behind a proxy with its own CA (as here) the builds take the host's CA certificates."""
    tool = _container_engine()
    assert tool is not None
    flags = _engine_flags(tool)
    if flags is None:
        pytest.skip(f"{tool} cannot start a container of {BASE} on this host")
    certificates = ["-v", "/etc/ssl/certs:/etc/ssl/certs:ro"] if Path("/etc/ssl/certs").is_dir() else []
    for name in ("device", "coordinator"):
        built = subprocess.run([tool, "build", "-q", *flags, "--network", "host", *certificates, "--build-arg",
                                f"BASE={BASE}", "-f", f"deploy/{name}.Containerfile", "-t", f"edgefil-{name}-test", "."],
                               cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    user = subprocess.run([tool, "run", "--rm", *flags, "--entrypoint", "id", "edgefil-device-test", "-u"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert user != "0"  # the image's own user is not root

    port = free_port("127.0.0.1")
    lab = tmp_path / "lab"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{Path(mosquitto_path()).parent}:{os.environ['PATH']}"}
    for step in (["edgefil", "init", str(lab), "--devices", "pi-1", "--port", str(port)],
                 ["edgefil", "data", "split", "--preset", "digits-class", "--devices", "pi-1", "--calibration", "10",
                  "--out", str(lab / "data")],
                 ["edgefil", "export", "--model", "lenet", "--classes", "10", "--input-shape", "1,8,8", "--out",
                  str(lab / "artifacts"), "--backends", "portable,torch"]):
        subprocess.run(step, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=600)
    config = lab / "coordinator.toml"
    config.write_text(config.read_text().replace("rounds_per_task = 3", "rounds_per_task = 1"))
    (tmp_path / "state").mkdir()
    # the operator: this user, or one who is not root where the tests run as root (root reads any file)
    uid, gid = (os.getuid(), os.getgid()) if os.getuid() != 0 else (4242, 4242)
    for folder in (lab, tmp_path / "state"):
        for path in (folder, *folder.rglob("*")):
            os.chown(path, uid, gid, follow_symlinks=False)
    me = f"{uid}:{gid}"
    subprocess.run(["mosquitto", "-c", str(lab / "broker" / "mosquitto.conf"), "-d"], check=True, env=env)
    names = [f"edgefil-test-coordinator-{port}", f"edgefil-test-pi-1-{port}"]
    try:
        coordinator = subprocess.Popen(
            [tool, "run", "--rm", "--name", names[0], *flags, "--network", "host", "--user", me, "-v", f"{lab}:{lab}",
             "edgefil-coordinator-test", "coordinator", "--config", str(config), "--device", "cpu"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        device = subprocess.run(
            [tool, "run", "--rm", "--name", names[1], *flags, "--network", "host", "--user", me, "-v", f"{lab}:/lab:ro",
             "-v", f"{tmp_path / 'state'}:/var/lib/edgefil", "edgefil-device-test", "client", "--config",
             "/lab/devices/pi-1.toml", "--state-dir", "/var/lib/edgefil"],
            capture_output=True, text=True, timeout=900)
        log, _ = coordinator.communicate(timeout=300)
    finally:
        subprocess.run([tool, "rm", "-f", *names], capture_output=True)
        subprocess.run(["kill", (lab / "broker" / "mosquitto.pid").read_text().strip()], check=False)
    assert coordinator.returncode == 0, log[-3000:]
    assert device.returncode == 0, device.stdout[-2000:] + device.stderr[-2000:]
    results = json.loads((lab / "run" / "results.json").read_text())
    assert results["outcome"] == "complete" and results["rounds_completed"] == 5, results.get("outcome")
    assert [len(row) for row in results["accuracy_matrix"]] == [1, 2, 3, 4, 5]
    assert any((tmp_path / "state").iterdir())  # the device kept its state on the volume
    assert not (lab / "state").exists()  # nothing written into the read-only lab
