"""The live dashboard of a run: a page that shows a run folder's `live.json` (or `results.json`) as it changes.

It reads files only: the coordinator writes them (coordinator/run_logs.py), the dashboard serves them, so it works
beside a running coordinator (`edgefil dashboard RUN_DIR`, or `--dashboard` on `edgefil coordinator` and
`edgefil fleet run`, a thread of that process) and on a finished run alike, and nothing it does, failing included,
reaches the training. The standard library's HTTP server serves it; the charts are uPlot (MIT, its minified build
shipped in `static/`, no CDN, no build step).

Bound to a loopback address it needs nothing; bound elsewhere it needs a token (`--token`, or one made at start and
printed with the address), given as `?token=` in the page's address or an `Authorization: Bearer` header, compared in
constant time. Without a token, a request must name a loopback host in its Host header: a page elsewhere that makes
its own name resolve to 127.0.0.1 (DNS rebinding) is refused. The page and its data are read-only; no request
changes anything.

What a client can hold of it is bounded: at most `max_connections` connections are served at a time (one thread
each; more are closed at once), and a connection that sends nothing for `idle_timeout_s` is closed. A client that
hangs up mid-answer costs one debug line, not a traceback in the coordinator's log.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import math
import secrets
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from coordinator.preparation import PREPARING_FILE
from edgefil.thread_names import NamedThread

log = logging.getLogger("edgefil.dashboard")
LIVE_FILE = "live.json"  # coordinator.run_logs writes these; the dashboard only reads them
RESULTS_FILE = "results.json"
FLEET_FILE = "fleet.json"  # a simulated fleet's settings (policy, budget M), where there is one
STATIC = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
MAX_CONNECTIONS = 32  # served at a time, a thread each: a browser opens a handful
IDLE_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str | None) -> str:
    """The host a Host header names, without its port or an IPv6 literal's brackets ('' when absent)."""
    value = (header or "").strip()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def _read_json(path: Path) -> Any:
    """A JSON file, or None where it is absent or caught mid-replace (every writer replaces atomically, but a
    finished run's file may be hand-edited)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _finite(value: Any) -> Any:
    """JSON for a browser: a non-finite number (a diverged run's loss) becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run_view(folder: Path) -> dict[str, Any]:
    """What the page shows of a run folder: the newer of live.json and results.json, the fleet's settings, and
    until the run has either its preparation's step under way."""
    live, results = folder / LIVE_FILE, folder / RESULTS_FILE

    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return -1.0

    newest = live if mtime(live) >= mtime(results) else results
    run = _read_json(newest) or _read_json(results if newest == live else live)
    preparing = _read_json(folder / PREPARING_FILE) if run is None else None
    return _finite({"folder": folder.name, "run": run, "fleet": _read_json(folder / FLEET_FILE),
                    "preparing": preparing})


class BoundedServer(ThreadingHTTPServer):
    """The standard library's threading HTTP server, holding at most `max_connections` connections (a thread each)
    at a time: one more is closed at once, so idle or slow clients cannot pile up threads. An error a client
    causes (it hung up, it sent nothing in time) is logged in one line."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int
                 ) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections closed because every slot was taken

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, socket.timeout)):
            log.debug("dashboard client %s: %s", client_address[0], error.__class__.__name__)
        else:
            log.warning("dashboard request from %s failed: %r", client_address[0], error)


class Dashboard:
    """A dashboard of `folder`, served on (host, port) from a daemon thread once `start` is called."""

    def __init__(self, folder: str | Path, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.folder = Path(folder)
        self.token = token if token is not None else (None if is_loopback(host) else secrets.token_urlsafe(16))
        self.server = BoundedServer((host, port), _handler(self, idle_timeout_s), max_connections)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = str(self.server.server_address[0]), self.server.server_address[1]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/" + (f"?token={self.token}" if self.token else "")

    def start(self) -> Dashboard:
        self._thread = NamedThread(target=self.server.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def allowed(self, query: dict[str, list[str]], authorization: str | None, host: str | None) -> bool:
        """With a token: the request carries it. Without: the request names a loopback host (no DNS rebinding)."""
        if self.token is None:
            return is_loopback(host_name(host))
        given = (query.get("token") or [""])[0]
        if authorization and authorization.startswith("Bearer "):
            given = authorization[len("Bearer "):]
        return hmac.compare_digest(given.encode(), self.token.encode())


def start_dashboard(folder: str | Path, address: str) -> Dashboard | None:
    """`--dashboard [HOST:]PORT` of a command that runs a fleet or a coordinator: the dashboard in a thread of it,
    or None (logged) when it cannot listen there; the run goes on either way."""
    host, _, port = address.rpartition(":")
    try:
        dashboard = Dashboard(folder, host or "127.0.0.1", int(port)).start()
    except (OSError, ValueError) as err:
        log.warning("the dashboard cannot listen on %s (%s): the run goes on without it", address, err)
        return None
    log.warning("dashboard: %s", dashboard.url)  # at WARNING so it shows beside the run's progress
    return dashboard


def add_dashboard_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil dashboard RUN_DIR [--host H] [--port P] [--token T]` to the `edgefil` command's subparsers."""
    command = commands.add_parser("dashboard", help="serve the live dashboard of a run folder (running or finished)")
    command.add_argument("run_dir", help="the run folder (the coordinator's `out`, a fleet's `out`)")
    command.add_argument("--host", default="127.0.0.1", help="address to listen on (not loopback: a token is needed)")
    command.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free one)")
    command.add_argument("--token", help="the token the page needs off loopback (default: a new random one)")
    command.set_defaults(run=_run_dashboard)


def _run_dashboard(args: argparse.Namespace) -> int:
    folder = Path(args.run_dir)
    if not folder.is_dir():
        raise SystemExit(f"edgefil dashboard: {folder} is not a folder (give a run's `out`)")
    try:
        dashboard = Dashboard(folder, args.host, args.port, args.token)
    except OSError as err:
        raise SystemExit(f"edgefil dashboard: cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    print(f"dashboard of {folder}: {dashboard.url}  (Ctrl-C stops it)", flush=True)
    try:
        dashboard.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.server.server_close()
    return 0


def _handler(dashboard: Dashboard, idle_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    static = resources.files(__package__) / "static"

    class Handler(BaseHTTPRequestHandler):
        server_version = "edgefil-dashboard"
        timeout = idle_timeout_s  # StreamRequestHandler sets it on the connection: an idle one is closed

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            parts = urlsplit(self.path)
            if not dashboard.allowed(parse_qs(parts.query), self.headers.get("Authorization"),
                                     self.headers.get("Host")):
                why = (b"a token is needed: open the address the dashboard printed\n" if dashboard.token else
                       b"the Host header names no loopback address: open the address the dashboard printed\n")
                self._send(HTTPStatus.FORBIDDEN, why, "text/plain; charset=utf-8")
                return
            path = parts.path
            if path == "/api/run":
                body = json.dumps(run_view(dashboard.folder), allow_nan=False).encode()
                self._send(HTTPStatus.OK, body, "application/json")
                return
            name = "index.html" if path == "/" else path.removeprefix("/static/")
            if name not in STATIC:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
                return
            self._send(HTTPStatus.OK, (static / name).read_bytes(), STATIC[name])

        def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for key, value in HEADERS.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
            log.debug("%s %s", self.address_string(), format % args)

    return Handler
