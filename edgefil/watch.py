"""`edgefil watch`: the protocol's traffic of one fleet, decoded, one line per message, as it happens.

For people used to `mosquitto_sub`: the payloads are msgpack and the weights come in chunks, so this subscribes to
the fleet's topics (an observer account: read-only on the fleet, `edgefil credentials` and a simulated fleet write
its `observer.toml`) and prints who sent what: registrations, statuses, round messages, requests, notices, and, where
the account may read them (`--observer-reads-learning`; by default the observer reads the protocol's metadata only,
docs/security.md "Who reads what"), updates and blobs (once per blob, at its first chunk, with its size and chunk
count) and answers. A message the protocol's gate
would refuse (not msgpack, a field of the wrong type, a bad chunk checksum) is printed as refused with the gate's
one reason. Retained messages (the registrations and statuses the broker holds) are marked as such.

It reads only: it never publishes, so watching cannot disturb a run.
"""
from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from edgefil import topics, wire
from edgefil.link import BrokerSettings, Link
from edgefil.settings import ConfigError, Where, build, load_toml

BLOB_KINDS = wire.BLOB_KINDS


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _config(config: Mapping[str, Any], keep: tuple[str, ...] = ("epochs", "lr", "known_classes",
                                                                  "mask_seen_classes")) -> str:
    shown = {k: v for k, v in config.items() if k in keep or len(config) <= 4}
    more = len(config) - len(shown)
    return ", ".join(f"{k}={v}" for k, v in shown.items()) + (f" (+{more} more)" if more else "")


def _metrics(metrics: Mapping[str, Any]) -> str:
    shown = [f"{k}={v:.4g}" for k, v in metrics.items() if k in ("loss", "stored_samples", "device_seconds")]
    return ", ".join(shown)


DESCRIBE: dict[str, Callable[[wire.Message], str]] = {
    "register": lambda m: f"profile {m['profile']}, backend {m['backend']}, software {m['software']}",
    "status": lambda m: f"{m['state']} (round {m['round']})" + (f": {m['error']}" if m.get("error") else ""),
    "round": lambda m: (f"round {m['round']} (task {m['task']}), deadline {m['deadline_s']:.0f} s"
                        + (f", {_config(m['config'])}" if m["config"] else "")
                        + "".join(f", with {k}" for k in ("payload", "broadcast") if k in m)),
    "request": lambda m: f"round {m['round']}: asks for {', '.join(map(str, m['names']))}",
    "notice": lambda m: f"{m['reason']}: {m['detail']}",
    # secure aggregation's (what an observer reads of it: keys, neighbourhoods, who survived)
    "keys": lambda m: f"round {m['round']} (task {m['task']}), session {m['session']}: keys advertised"
                      + (f", {_metrics(m['metrics'])}" if m["metrics"] else ""),
    "neighbours": lambda m: (f"round {m['round']}, session {m['session']}: {len(m['neighbours'])} neighbours of "
                             f"{m['count']}, threshold {m['threshold']}"),
    "unmask": lambda m: (f"round {m['round']}, session {m['session']}: {len(m['survivors'])} neighbours survived, "
                         f"{len(m['dropped'])} dropped"),
}


def _blob(kind: str, m: wire.Message) -> str:
    """A blob's first chunk: what it is, its size and chunk count."""
    parts = [f"{_size(m['size'])} in {m['count']} chunk{'s' if m['count'] > 1 else ''}"]
    if kind == "update":
        parts.insert(0, f"round {m['round']} (task {m['task']}): {m['num_samples']} samples")
        if m["metrics"]:
            parts.append(_metrics(m["metrics"]))
    elif "round" in m:
        parts.insert(0, f"round {m['round']}")
    names = [a[0] for a in m.get("attachments", []) if isinstance(a, (list, tuple)) and a]
    if names:
        parts.append("attachments " + ", ".join(map(str, names)))
    return ", ".join(parts)


def describe(fleet: str, topic: str, payload: bytes | bytearray | memoryview, retained: bool) -> str | None:
    """The line for one message (without the time), or None for a blob's later chunks."""
    found = topics.parse_at_any_broker(fleet, topic)  # a site's device's too, across its site's bridge
    if found is None:
        return f"? {topic}: not a topic of the protocol"
    site, parsed = found
    via = "" if site is None else f" (via site {site})"
    if parsed.direction == topics.FROM_DEVICE:
        who = f"{parsed.device} -> coordinator{via}"
    elif parsed.direction == topics.TO_DEVICE:
        who = f"coordinator -> {parsed.device}{via}"
    else:
        who = "coordinator -> all"
    mark = " (retained)" if retained else ""
    if not payload:
        return f"{who} {parsed.kind}{mark}: cleared"
    try:
        message = wire.decode(payload)
    except wire.WireError as err:
        return f"{who} {parsed.kind}{mark}: REFUSED ({err})"
    kind = message.get("kind", parsed.kind)
    if kind != parsed.kind:
        return f"{who} {parsed.kind}{mark}: REFUSED (a {kind} message on the {parsed.kind} topic)"
    if kind in BLOB_KINDS:
        if message["index"] != 0:
            return None
        return f"{who} {kind}{mark}: {_blob(kind, message)}"
    text = DESCRIBE.get(kind, lambda m: "")(message)
    return f"{who} {kind}{mark}" + (f": {text}" if text else "")


def watch(fleet: str, broker: BrokerSettings, out: TextIO = sys.stdout, until: Callable[[], bool] = lambda: False,
          connect_timeout: float = 30.0) -> int:
    """Print the fleet's messages until `until()` (or Ctrl-C); returns how many were printed."""
    link = Link(broker, client_id=f"watch-{secrets.token_hex(4)}",
                subscriptions=[f"{topics.prefix(fleet)}/#"])
    link.start(timeout=connect_timeout)
    printed = 0
    try:
        while not until():
            item = link.get(timeout=0.2)
            if item is None or not item.topic.startswith(topics.ROOT + "/"):  # (and the link's own CONNECTED)
                continue
            line = describe(fleet, item.topic, item.payload, item.retained)
            if line is not None:
                stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
                print(f"{stamp}  {line}", file=out, flush=True)
                printed += 1
    finally:
        link.stop()
    return printed


def load_watch_config(path: Path, fleet: str | None) -> tuple[str, BrokerSettings]:
    """A file with `fleet` and a [broker] table: observer.toml, or a coordinator's or a device's config."""
    raw = load_toml(path)
    where = Where(str(path))
    fleet = fleet or raw.get("fleet")
    if not isinstance(fleet, str):
        raise ConfigError(f"{path}: no fleet = \"...\" (or pass --fleet)")
    table = raw.get("broker", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [broker] is not a table")
    return topics.check_name(fleet, "fleet"), build(BrokerSettings, table, where.inner("broker"), path.parent)


def add_watch_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil watch --config FILE [--fleet NAME]` to the `edgefil` command's subparsers."""
    command = commands.add_parser("watch", help="print a fleet's protocol traffic, decoded, as it happens")
    command.add_argument("--config", required=True,
                         help="a file with fleet = \"...\" and a [broker] table: the observer.toml that edgefil "
                              "credentials (or a fleet, in its broker/ folder) writes, or a coordinator's config")
    command.add_argument("--fleet", help="the fleet to watch (default: the file's)")
    command.set_defaults(run=_run_watch)


def _run_watch(args: argparse.Namespace) -> int:
    fleet, broker = load_watch_config(Path(args.config), args.fleet)
    try:
        watch(fleet, broker)
    except KeyboardInterrupt:
        return 0
    except ConnectionError as err:
        print(f"edgefil watch: cannot connect to {broker.host}:{broker.port}: {err}", file=sys.stderr)
        return 2
    return 0
