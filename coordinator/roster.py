"""Who is in the fleet and in what state: the coordinator's one record of its devices.

The roster takes the gate's registrations, statuses and accepted updates and keeps, per device of the run's list:
its registration (profile, backend), whether it is online, whether it holds data, the process instances it
registered with (two running at once share one id: a duplicate), the last error it reported, and what its latest
update said of it (round, stored bytes against its budget, label counts). The round engine asks it who can be
selected; the run record, the reports and the dashboard read its table. It decides nothing about rounds: how the
coordinator reacts (resend a round, stop waiting for a device) stays in the round loop.

A status from an instance other than the device's newest registered one (the late last will of a replaced process)
is passed over here, so no reader sees a stale offline.

Each device's row of the table is kept as its JSON text until its record changes (`table_texts`): live.json carries
the table and is written every second or two, so encoding every row at each write cost the coordinator in
proportion to the fleet times the round's length, about 5 % of its CPU at 10,000 devices (docs/results.md); a round
changes each row a few times. Only this class changes a record, and a method that does drops its row.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.inbox import Registration, Status, Update
from coordinator.secagg import Advertised

INSTANCES_KEPT = 4  # a device's most recent process instances remembered (a duplicate is one of these again)


@dataclass
class DeviceRecord:
    """One device as the coordinator knows it; `state` is "unseen" until it registers, then its last status
    (online states, "offline", "error", "no-data", "spent"), or "training" from the round message it was sent to its
    update, "idle" after it (`Roster.asked_to_train`, `Roster.take_update`), or "failed" once out of the run
    (`Roster.fail`)."""

    device: str
    profile: str = ""
    backend: str = ""
    state: str = "unseen"
    last_seen: float | None = None  # wall-clock time of its last registration, status or update
    last_round: int = 0  # the last round it delivered an update for (0: none yet)
    stored_samples: int | None = None  # from its latest update's metrics
    stored_bytes: int | None = None
    budget_bytes: int | None = None  # its store's byte budget (None: none)
    budget_samples: int | None = None  # its store's sample budget (None: none)
    label_counts: tuple[int, ...] = ()  # its latest update's samples per class
    error: str = ""  # the last reason it gave for not training
    error_round: int | None = None
    instances: list[str] = field(default_factory=list)  # its process instances, newest last

    def as_dict(self, online: bool) -> dict[str, Any]:
        return {
            "device": self.device, "profile": self.profile, "backend": self.backend, "state": self.state,
            "online": online, "last_seen": self.last_seen, "last_round": self.last_round,
            "stored_samples": self.stored_samples, "stored_bytes": self.stored_bytes,
            "budget_bytes": self.budget_bytes, "budget_samples": self.budget_samples,
            "label_counts": list(self.label_counts), "error": self.error,
            "error_round": self.error_round,
        }


def _count(metrics: Any, name: str) -> int | None:
    value = metrics.get(name)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


class Roster:
    """The devices of a run (the config's list), their registrations and states."""

    def __init__(self, devices: Iterable[str]) -> None:
        self.records = {d: DeviceRecord(d) for d in devices}
        self.registered: dict[str, Registration] = {}
        self.online: set[str] = set()
        # online, but holding no data to train on (status "no-data"): device -> the task it said so in
        self.without_data: dict[str, int] = {}
        # online, past the local privacy budget it set itself (status "spent", edge_client/privacy.py): device -> its
        # reason. For the run: a device does not get its budget back.
        self.spent: dict[str, str] = {}
        self.duplicates: dict[str, list[str]] = {}  # device -> instances seen running at once
        # out of the run (`fail`): device -> why. For the run: what it says later is passed over
        self.failed: dict[str, str] = {}
        self._rows: dict[str, bytes] = {}  # device -> its table row's JSON text, until its record changes

    def register(self, event: Registration) -> list[str] | None:
        """Take a registration; the two instances when an older process of the device registers again (two
        processes share its id), else None."""
        record = self.records[event.device]
        self._rows.pop(event.device, None)
        record.profile, record.backend, record.last_seen = event.profile, event.backend, time.time()
        self.registered[event.device] = event  # online is what its (retained) status says
        if not event.instance:
            return None
        seen = record.instances
        if seen and seen[-1] == event.instance:
            return None
        both = None
        if event.instance in seen:  # a restart never brings an old instance back
            both = sorted({event.instance, seen[-1]})
            self.duplicates[event.device] = both
            seen.remove(event.instance)
        seen.append(event.instance)
        del seen[:-INSTANCES_KEPT]
        return both

    def instance(self, device: str) -> str:
        """The device's newest registered process instance ("" before one)."""
        seen = self.records[device].instances
        return seen[-1] if seen else ""

    def is_stale(self, event: Status) -> bool:
        """A status of a replaced process (its last will arriving late): to be passed over."""
        newest = self.instance(event.device)
        return bool(event.instance and newest and event.instance != newest)

    def take_status(self, event: Status, task: int) -> None:
        """Record a (current) status: online or not, with data or not, and an error's reason. `task`: the task the
        run is on, which a "no-data" that names none speaks for."""
        if event.device in self.failed:
            return
        record = self.records[event.device]
        self._rows.pop(event.device, None)
        record.state, record.last_seen = event.state, time.time()
        if event.state == "error":
            self.online.add(event.device)
            record.error, record.error_round = event.error, event.round
        elif event.state == "no-data":
            self.online.add(event.device)
            self.without_data[event.device] = task if event.task is None else event.task
        elif event.state == "spent":
            self.online.add(event.device)
            self.spent[event.device] = event.error or "its local privacy budget is spent"
        elif event.state == "offline":
            self.without_data.pop(event.device, None)
            self.online.discard(event.device)
        else:
            self.without_data.pop(event.device, None)
            self.online.add(event.device)

    def fail(self, device: str, why: str) -> None:
        """The device is out of the run (its host said it failed to start, or stopped on an error, `why`): state
        "failed", offline, `why` as its error, for the rest of the run."""
        record = self.records[device]
        self._rows.pop(device, None)
        record.state, record.error = "failed", why
        self.failed[device] = why
        self.online.discard(device)
        self.without_data.pop(device, None)

    def asked_to_train(self, device: str) -> None:
        """The device was sent a round's work: "training" until its update (or its word that it cannot) comes. A
        device says nothing of a round's progress itself (edge_client/device.py `_publish_status`)."""
        self._rows.pop(device, None)
        self.records[device].state = "training"

    def take_update(self, update: Update | Advertised) -> None:
        """Record what an accepted update says of its device: its round's work is done ("idle")."""
        record = self.records[update.device]
        self._rows.pop(update.device, None)
        record.state = "idle"
        record.last_round = max(record.last_round, update.round)
        record.last_seen = time.time()
        record.stored_samples = _count(update.metrics, "stored_samples")
        record.stored_bytes = _count(update.metrics, "stored_bytes")
        record.budget_bytes = _count(update.metrics, "store_budget_bytes") or None  # 0: no byte budget
        record.budget_samples = _count(update.metrics, "store_budget_samples") or None
        record.label_counts = tuple(update.label_counts)

    def connected(self) -> set[str]:
        """Registered and online: a set operation in C, cheap enough to ask between slices of messages."""
        return self.registered.keys() & self.online

    def available(self, task: int) -> set[str]:
        """What a round of `task` selects from: connected, not past its privacy budget, and not known to hold no
        data for it. A device that said it held none in an earlier task is selected again: one that joins at this
        task trains from its first round on (it hears the task from the round it is sent), and one that still holds
        none says so again and is not waited for."""
        return self.connected() - {d for d, said in self.without_data.items() if said >= task} - self.spent.keys()

    def errors(self) -> dict[str, dict[str, Any]]:
        """Device -> its last reported error and round (devices that reported one)."""
        return {d: {"round": r.error_round, "error": r.error} for d, r in self.records.items()
                if r.error_round is not None}

    def table(self) -> list[dict[str, Any]]:
        """Every device of the run, in the run's order, as the reports and the dashboard show it."""
        return [r.as_dict(d in self.online) for d, r in self.records.items()]

    def table_texts(self) -> list[bytes]:
        """`table()`'s rows as their JSON texts, each encoded once until its record changes."""
        rows = self._rows
        return [rows.get(d) or rows.setdefault(d, json.dumps(r.as_dict(d in self.online)).encode())
                for d, r in self.records.items()]
