"""Reports of runs: one run folder's `results.json` -> summary.md and three plots; several runs -> one table and
one plot, so methods can be compared (`edgefil report DIR [DIR ...]`).

Runs of flowing scenarios also carry pFedGRP's IAA: `results["iaa"]` (one value per round, from which AA and AFM
are computed) and per-round history entries with "iaa" and "client_accuracy" (device -> a_k^t), drawn as a
fourth plot. Runs without them are reported exactly as before.

Every number comes from `edgefil.metrics`; this module only gathers the metrics' inputs from the
coordinator's per-round history and lays the results out. matplotlib is imported by the plot helpers only (and
drawn on bare `Figure`s, no pyplot, so no display or global backend is involved), which keeps importing this
module cheap."""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgefil.metrics import (
    LAST_ROUNDS,
    LastRounds,
    accuracy_matrix,
    average_accuracy,
    average_incremental_accuracy,
    average_of_iaa,
    backward_transfer,
    forgetting,
    iaa_forgetting,
    last_rounds_accuracy,
    peak_storage,
    rounds_to_best,
    traffic_summary,
)

RESULTS = "results.json"
FLEET_FILE = "fleet.json"  # a simulated fleet's configuration (FleetConfig.describe), beside results.json


def load_run(folder: str | Path) -> dict[str, Any]:
    """The `results.json` of a run folder; errors name the file, since a report often reads many folders."""
    path = Path(folder) / RESULTS
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no {RESULTS} here; is {folder} a run folder?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(results, dict) or not {"accuracy_matrix", "history"} <= results.keys():
        raise ValueError(f"{path}: not a run's results (no accuracy_matrix or history)")
    return results


def _reports(history: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Each device's reported metrics in round order (a device reports only in rounds it was received in)."""
    reports: dict[str, list[Mapping[str, Any]]] = {}
    for entry in history:
        for device, metrics in entry["metrics"].items():
            reports.setdefault(device, []).append(metrics)
    return dict(sorted(reports.items()))


def _series(reports: Mapping[str, Sequence[Mapping[str, Any]]], key: str) -> dict[str, list[Any]]:
    return {d: [m[key] for m in ms if key in m] for d, ms in reports.items()}


def reported_budgets(results: Mapping[str, Any]) -> dict[str, int]:
    """Each device's store byte budget, as its updates report it (devices without one are left out)."""
    return {
        device: int(metrics["store_budget_bytes"])
        for entry in results["history"] for device, metrics in entry["metrics"].items()
        if metrics.get("store_budget_bytes")
    }


def reported_sample_budgets(results: Mapping[str, Any]) -> dict[str, int]:
    """Each device's sample budget M, as its updates report it (devices without one are left out)."""
    return {
        device: int(metrics["store_budget_samples"])
        for entry in results["history"] for device, metrics in entry["metrics"].items()
        if metrics.get("store_budget_samples")
    }


def run_summary(results: Mapping[str, Any], budget: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The numbers a report shows. Accuracy metrics come from the accuracy matrix (None before a task completes);
    "average_accuracy" is the average incremental accuracy (the final-style accuracy after each task, averaged
    over tasks). Traffic uses each device's last reported cumulative bytes; storage the peak of its stored-byte
    readings, checked against `budget` where it names the device (else budget and within_budget are None).
    "aa" and "afm" (pFedGRP's Eqs. 10-11) come from the run's per-round IAA, None where it has none."""
    iaa = results.get("iaa") or None
    acc = accuracy_matrix(results["accuracy_matrix"]) if results["accuracy_matrix"] else None
    tasks = len(acc) if acc is not None else 0
    reports = _reports(results["history"])
    sent = {d: s[-1] for d, s in _series(reports, "bytes_sent").items() if s}
    received = {d: s[-1] for d, s in _series(reports, "bytes_received").items() if s}
    budget = budget if budget is not None else reported_budgets(results)
    stored = _series(reports, "stored_bytes")
    sample_budgets = reported_sample_budgets(results)
    storage = peak_storage(stored, {d: float(budget.get(d, math.inf)) for d in stored})
    for device in stored.keys() - budget.keys():
        storage[device].update(budget=None, within_budget=None)
    return {
        "rounds": results["rounds_completed"],
        "tasks_completed": tasks,
        "accuracy_matrix": acc,
        "final_accuracy": average_accuracy(acc) if acc is not None else None,
        "last_rounds": (last_rounds_accuracy(results["history"], _last_rounds(results))
                        if results["history"] else None),
        "average_accuracy": average_incremental_accuracy(acc) if acc is not None else None,
        "forgetting": forgetting(acc) if acc is not None else None,
        "backward_transfer": backward_transfer(acc) if acc is not None else None,
        "iaa": iaa,
        "aa": average_of_iaa(iaa) if iaa else None,
        "afm": iaa_forgetting(iaa) if iaa else None,
        "cor": rounds_to_best(results["history"], results["scenario"]["n_tasks"]),
        "traffic": traffic_summary(sent, received),
        "storage": storage,
        "device_seconds": {d: float(sum(s)) if s else None for d, s in _series(reports, "device_seconds").items()},
        "stored_samples": {d: {"peak": max(s), "budget": sample_budgets.get(d)}
                           for d, s in _series(reports, "stored_samples").items() if s},
        "devices": {d["device"]: d for d in results.get("devices", [])},  # the coordinator's roster at the end
        "refusals": dict(results.get("counters", {})),
    }


def _round_axis(history: Sequence[Mapping[str, Any]], rounds_per_task: int) -> list[float]:
    """Where each history entry goes on a round axis: a trained round at its number; an evaluation-only task (a
    Fixed run past its `train_tasks`, which keeps the round count) `rounds_per_task` further on than the entry
    before it, where the task would have ended had it been trained. So a Fixed run is drawn task by task beside
    the runs that train every task, not as a vertical line at its last trained round."""
    xs: list[float] = []
    for entry in history:
        xs.append(xs[-1] + rounds_per_task if xs and entry.get("trained") is False else float(entry["round"]))
    return xs


def _last_rounds(results: Mapping[str, Any]) -> int:
    """How many of the last task's rounds the run's last-rounds mean covers (its coordinator's `last_rounds`)."""
    return int((results.get("settings") or {}).get("last_rounds") or LAST_ROUNDS)


def _last_rounds_text(last: LastRounds | None) -> str:
    """"81.20% ± 1.30 (last 10 rounds)": the mean over the last task's last rounds, with their spread."""
    if last is None:
        return "—"
    return f"{last.mean:.2%} ± {100 * last.std:.2f} (last {last.rounds} round{'s' if last.rounds != 1 else ''})"


def _rounds_per_task(results: Mapping[str, Any]) -> int:
    return int((results.get("settings") or {}).get("rounds_per_task") or 1)


def _round_accuracy(results: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """Per round: the global model's mean accuracy over the tasks seen so far (the coordinator's final_accuracy)."""
    history = results["history"]
    return _round_axis(history, _rounds_per_task(results)), [float(np.mean(e["accuracy"])) for e in history]


def _round_iaa(results: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """Per round that carries one: pFedGRP's IAA (flowing runs)."""
    points = [(e["round"], float(e["iaa"])) for e in results["history"] if "iaa" in e]
    return [r for r, _ in points], [v for _, v in points]


def _mean_cor(summary: Mapping[str, Any]) -> float | None:
    counts = [c for c in summary["cor"] if c is not None]
    return float(np.mean(counts)) if counts else None


# --- markdown -----------------------------------------------------------------------------------------------

def _pct(value: float | None) -> str:
    return "—" if value is None or np.isnan(value) else f"{value:.2%}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _described(scenario: Mapping[str, Any]) -> tuple[str, Callable[[int], str]]:
    """The scenario in words and its tasks' names, as its kind gives them (firmware_sim/scenario_kinds/), read
    off the recorded fields as they are (a run of another version may not validate today); a generic wording
    for a kind this edgefil does not know."""
    import dataclasses
    from types import SimpleNamespace

    from firmware_sim.scenario_kinds import KINDS
    from firmware_sim.scenarios import Scenario

    if "kind" not in scenario and "test_data" in scenario:  # a deployment's test sets, not a scenario
        return (f"test sets from `{scenario['test_data']}`, {scenario.get('n_tasks', '?')} tasks",
                lambda t: f"task {t}")
    fields = {f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(Scenario)}
    recorded: Any = SimpleNamespace(**{**fields, **scenario})
    try:
        kind = KINDS.get(str(scenario.get("kind")))()
    except ValueError:
        return (f"{scenario.get('kind', '?')}-incremental, {scenario.get('n_tasks', '?')} tasks",
                lambda t: f"task {t}")
    return kind.setting(recorded), lambda t: kind.task_label(recorded, t)


def _privacy_rows(results: Mapping[str, Any]) -> list[list[Any]]:
    """Central DP's spend (coordinator/privacy.py): epsilon at the run's delta, and its budget; local DP's
    (edge_client/privacy.py): the largest epsilon a device reported; secure aggregation's sessions
    (coordinator/secagg.py): the vectors its rounds summed, and what its sessions refused or failed on (the
    `secure-*` counters); none without any of them."""
    rows = []
    privacy = results.get("settings", {}).get("privacy", {})
    if privacy.get("mode") == "central":
        epsilon = results.get("epsilon")
        budget = privacy.get("epsilon_budget") or "none"
        rows.append(["privacy (central DP)", f"epsilon {'—' if epsilon is None else f'{epsilon:.3f}'} at delta "
                     f"{privacy.get('delta')}; budget {budget}; clip {privacy.get('clip_norm')}, noise multiplier "
                     f"{privacy.get('noise_multiplier')}"])
    if results.get("local_epsilon") is not None:
        rows.append(["privacy (local DP)", f"epsilon {results['local_epsilon']:.3f} at the devices' delta: the "
                     f"largest a device reported"])
    if results.get("settings", {}).get("secure_aggregation", {}).get("mode", "off") != "off":
        sessions = [entry["secure"] for entry in results.get("history", []) if "secure" in entry]
        summed, advertised = (sum(s.get(stage, 0) for s in sessions) for stage in ("masked", "advertised"))
        refused = [f"{k} {n}" for k, n in sorted(results.get("counters", {}).items()) if k.startswith("secure-")]
        rows.append(["secure aggregation (SecAgg+)", f"{summed} masked vectors summed of {advertised} devices' keys, "
                     f"in {len(sessions)} rounds; {', '.join(refused) or 'nothing refused, no session failed'}"])
    return rows


def _devices_markdown(s: Mapping[str, Any]) -> str:
    """One row per device: its profile and state at the end (the roster's, where the run has one), its peak store
    against its budget, its traffic, and the last reason it gave for not training."""
    traffic, roster = s["traffic"]["devices"], s["devices"]
    names = sorted(traffic.keys() | roster.keys() | s["storage"].keys())

    def stored(d: str) -> str:
        samples = s["stored_samples"].get(d)
        if samples is not None and samples["budget"]:
            return f"{samples['peak']} / M = {samples['budget']}"
        peak, budget = s["storage"].get(d, {}).get("peak"), s["storage"].get(d, {}).get("budget")
        return _bytes(peak) + (f" / {_bytes(budget)}" if budget else "")

    def reason(d: str) -> str:
        row = roster.get(d, {})
        return f"round {row['error_round']}: {row['error']}" if row.get("error") else ""

    rows = [[d, roster.get(d, {}).get("profile") or "—", roster.get(d, {}).get("state", "—"), stored(d),
             _bytes(traffic.get(d, {}).get("sent")), _bytes(traffic.get(d, {}).get("received")),
             "—" if s["device_seconds"].get(d) is None else f"{s['device_seconds'][d]:.2f}", reason(d)]
            for d in names]
    table = _table(["device", "profile", "state at the end", "peak stored / budget", "sent", "received",
                    "device seconds", "last reason it could not train"], rows)
    silent = [d for d, row in roster.items() if d not in traffic and row.get("state") != "no-data"]
    return table + (f"\n\nNever delivered an update: {', '.join(silent)}." if silent else "")


def _settings_markdown(results: Mapping[str, Any], fleet: Mapping[str, Any]) -> str:
    """What this run compared: its policy and budget M (a fleet's fleet.json), E and the other round settings, the
    rule, the devices' profiles."""
    settings = results.get("settings") or {}
    client = {**(fleet.get("client") or {}), **(settings.get("client") or {})}
    policy, budget = describe_policy(fleet) if fleet else ("—", "—")
    roster = results.get("devices") or []
    profiles = fleet.get("profiles") or {}
    if not profiles and roster:
        counted: dict[str, int] = {}
        for row in roster:
            counted[row.get("profile") or "unknown"] = counted.get(row.get("profile") or "unknown", 0) + 1
        profiles = counted
    rows = [
        ["replay policy", policy], ["budget M", budget],
        ["local epochs E", client.get("epochs", "the devices' own")],
        ["learning rate", client.get("lr", "the devices' own")],
        ["aggregation rule", describe_rule(results.get("strategy", {}))],
        ["rounds per task", settings.get("rounds_per_task", "—")],
        ["quorum / selected share", f"{settings.get('min_clients', '—')} / {settings.get('fraction', '—')}"],
        ["devices", ", ".join(f"{n} {p}" for p, n in profiles.items()) or settings.get("devices", "—")],
    ]
    if settings.get("train_tasks"):
        rows.append(["trained tasks", f"the first {settings['train_tasks']} (the rest evaluated only)"])
    return _table(["setting", "value"], rows)


def _summary_markdown(label: str, results: Mapping[str, Any], s: Mapping[str, Any],
                      fleet: Mapping[str, Any] | None = None) -> str:
    sc, strategy = results["scenario"], dict(results["strategy"])
    name = strategy.pop("name", "?")
    options = ", ".join(f"{k}={v}" for k, v in strategy.items())
    traffic = s["traffic"]
    flowing = [
        ["AA (IAA averaged over rounds)", _pct(s["aa"])],
        ["AFM (mean IAA drop per round)", _pct(s["afm"])],
    ] if s["aa"] is not None else []
    headline = _table(["metric", "value"], [
        *flowing,
        ["final accuracy (after the last task)", _pct(s["final_accuracy"])],
        ["final accuracy over the last rounds (mean ± std)", _last_rounds_text(s["last_rounds"])],
        ["average accuracy", _pct(s["average_accuracy"])],
        ["forgetting", _pct(s["forgetting"])],
        ["backward transfer", _pct(s["backward_transfer"])],
        ["rounds", s["rounds"]],
        ["tasks completed", f"{s['tasks_completed']} of {sc['n_tasks']}"],
        ["device traffic (sent / received)", f"{_bytes(traffic['sent'])} / {_bytes(traffic['received'])}"],
        ["coordinator traffic (sent / received)",
         f"{_bytes(results.get('bytes_sent'))} / {_bytes(results.get('bytes_received'))}"],
        ["reconnects", results.get("reconnects", "—")],
        *_privacy_rows(results),
    ])
    acc = s["accuracy_matrix"]
    names = _described(sc)[1]
    matrix = _table(["after"] + [names(j) for j in range(s["tasks_completed"])],
                    [[names(i)] + [_pct(v) if j <= i else "" for j, v in enumerate(row)] for i, row in enumerate(acc)]
                    ) if acc is not None else "No task completed yet."
    cor = _table(["task", "rounds to best"], [[names(t), "—" if c is None else c] for t, c in enumerate(s["cor"])])
    devices = _devices_markdown(s)
    refusals = _table(["reason", "count"], sorted(s["refusals"].items())) if s["refusals"] else "None."
    setting = _described(sc)[0]
    data = f"scenario `{sc['dataset']}`, {setting}" if "dataset" in sc else setting
    return "\n\n".join([
        f"# Run report: {label}",
        f"Fleet `{results.get('fleet', '?')}`, strategy `{name}`{f' ({options})' if options else ''}; {data}"
        + (f"; outcome {results['outcome']}." if "outcome" in results else "."),
        headline,
        "## What was run",
        _settings_markdown(results, fleet or {}),
        "## Accuracy matrix\n\nRow i: the global model after task i, on each task seen so far.",
        matrix,
        "## Rounds to best accuracy (CoR)\n\nPer task: rounds from its start until its best accuracy (1 = first).",
        cor,
        "## Devices\n\nTraffic is each device's cumulative MQTT bytes at its last report.",
        devices,
        "## Refusals",
        refusals,
    ]) + "\n"


def load_fleet(folder: str | Path) -> dict[str, Any]:
    """A simulated fleet's `fleet.json` ({} for a run that has none, e.g. a real coordinator's)."""
    try:
        fleet = json.loads((Path(folder) / FLEET_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return fleet if isinstance(fleet, dict) else {}


def describe_policy(fleet: Mapping[str, Any]) -> tuple[str, str]:
    """(policy, budget M) as a comparison names them: "refed by class", "M = 50" or "M = 64 kB"; "—" unknown."""
    policy = fleet.get("policy") or {}
    name = str(policy.get("name", "—")) + (f" by {policy['group_by']}" if policy.get("group_by") else "")
    if fleet.get("coordinator", {}).get("train_tasks"):
        trained = int(fleet["coordinator"]["train_tasks"])
        name += f" (trains {trained} task{'s' if trained > 1 else ''} only)"
    store = fleet.get("store") or {}
    budget = ", ".join([*([f"M = {store['max_samples']}"] if "max_samples" in store else []),
                        *([_bytes(store["max_bytes"])] if "max_bytes" in store else [])]) or "—"
    return name, budget


def describe_rule(strategy: Mapping[str, Any]) -> str:
    """The aggregation rule with the options it was given: "fedavg (weighted = False)"."""
    options = ", ".join(f"{k} = {v}" for k, v in strategy.items() if k != "name")
    return str(strategy.get("name", "?")) + (f" ({options})" if options else "")


def _comparison_markdown(labels: Sequence[str], runs: Sequence[Mapping[str, Any]],
                         summaries: Sequence[Mapping[str, Any]], fleets: Sequence[Mapping[str, Any]]) -> str:
    with_iaa = any(s["aa"] is not None for s in summaries)
    described = [dict(zip(("policy", "budget"), describe_policy(fleet)), aggregation=describe_rule(results["strategy"]),
                      E=str({**(fleet.get("client") or {}), **(results.get("settings") or {}).get("client", {})}
                            .get("epochs", "—")))
                 for results, fleet in zip(runs, fleets)]
    differ = [k for k in described[0] if len({d[k] for d in described}) > 1]  # what the comparison is about
    shared = [f"{k} {described[0][k]}" for k in described[0] if k not in differ and described[0][k] != "—"]
    rows = []
    for label, s, what in zip(labels, summaries, described):
        cor = _mean_cor(s)
        peaks = [p["peak"] for p in s["storage"].values()]
        rows.append([label, *(what[k] for k in differ), s["rounds"], _pct(s["final_accuracy"]),
                     _last_rounds_text(s["last_rounds"]),
                     _pct(s["average_accuracy"]), _pct(s["forgetting"]), _pct(s["backward_transfer"]),
                     *([_pct(s["aa"]), _pct(s["afm"])] if with_iaa else []),
                     "—" if cor is None else f"{cor:.2f}",
                     _bytes(s["traffic"]["sent"] + s["traffic"]["received"]), _bytes(max(peaks, default=None))])
    header = ["run", *differ, "rounds", "final acc.", "last rounds (mean ± std)", "average acc.", "forgetting", "BWT",
              *(["AA", "AFM"] if with_iaa else []), "mean CoR", "device traffic", "max peak stored"]
    alike = f"Every run: {', '.join(shared)}.\n\n" if shared and len(runs) > 1 else ""
    return "# Run comparison\n\n" + alike + _table(header, rows) + "\n"


# --- plots --------------------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _plot_matrix(acc: np.ndarray | None, path: Path) -> Path:
    n = 0 if acc is None else len(acc)
    fig = _figure(2.5 + 0.7 * n, 2 + 0.6 * n)
    ax = fig.add_subplot()
    if n == 0 or acc is None:
        ax.text(0.5, 0.5, "no task completed yet", ha="center", va="center")
        ax.set_axis_off()
    else:
        image = ax.imshow(np.ma.masked_invalid(acc), cmap="viridis", vmin=0.0, vmax=1.0)
        fig.colorbar(image, ax=ax, label="accuracy")
        size = 10 if n <= 6 else 7 if n <= 12 else 5
        for (i, j), value in np.ndenumerate(acc):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=size,
                        color="black" if value > 0.6 else "white")
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xlabel("evaluated on task")
        ax.set_ylabel("after training task")
    ax.set_title("Accuracy matrix")
    fig.savefig(path, dpi=120)
    return path


def _evaluated_only(history: Sequence[Mapping[str, Any]]) -> bool:
    return any(e.get("trained") is False for e in history)


def _plot_per_task(results: Mapping[str, Any], path: Path,
                   names: Callable[[int], str] = lambda t: f"task {t}") -> Path:
    history = results["history"]
    xs = _round_axis(history, _rounds_per_task(results))
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    tasks = max((e["task"] for e in history), default=-1) + 1
    for t in range(tasks):
        points = [(x, e["accuracy"][t], e.get("trained") is not False)
                  for x, e in zip(xs, history) if len(e["accuracy"]) > t]
        line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=names(t),
                       drawstyle="steps-post" if _evaluated_only(history) else "default")[0]
        untrained = [p for p in points if not p[2]]
        if untrained:  # evaluated, not trained: hollow
            ax.plot([p[0] for p in untrained], [p[1] for p in untrained], ls="none", marker="o", markersize=6,
                    markerfacecolor="white", color=line.get_color())
        start = min(x for x, e in zip(xs, history) if e["task"] == t)
        ax.axvline(start - 0.5, color="grey", lw=0.5, ls=":")
    if history:
        ax.plot(*_round_accuracy(results), color="black", lw=2, ls="--", label="mean of seen tasks",
                drawstyle="steps-post" if _evaluated_only(history) else "default")
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("round (dotted: a task starts; hollow: evaluated only, not trained)"
                  if _evaluated_only(history) else "round (dotted: a task starts)")
    ax.set_ylabel("accuracy of the global model")
    ax.set_title("Accuracy on each task over rounds")
    fig.savefig(path, dpi=120)
    return path


def _device_axis(ax, devices: Sequence[str]) -> None:
    if len(devices) <= 40:
        ax.set_xticks(range(len(devices)))
        ax.set_xticklabels(devices, rotation=90, fontsize="small")
    else:
        ax.set_xticks([])
        ax.set_xlabel(f"{len(devices)} devices")


# Past this many devices each is a step of one line, not a bar of its own, in a figure of fixed width: a bar a
# device drew 10,000 devices' figure 3,500 inches wide, for minutes, at the end of every such run.
BARS_UP_TO = 60


def _per_device(ax, x: np.ndarray, values: Sequence[float], offset: float = 0.0, width: float = 0.8,
                **style: Any) -> None:
    if len(x) <= BARS_UP_TO:
        ax.bar(x + offset, values, width=width, **style)
    else:
        ax.stairs(values, np.append(x, len(x)) - 0.5, **style)


def _plot_devices(summary: Mapping[str, Any], path: Path) -> Path:
    traffic, storage = summary["traffic"]["devices"], summary["storage"]
    devices = sorted(traffic.keys() | storage.keys())
    x = np.arange(len(devices))
    fig = _figure(max(8, 0.35 * len(devices) + 3) if len(devices) <= BARS_UP_TO else 16, 4.5)
    left, right = fig.subplots(1, 2)
    samples = summary["stored_samples"]
    if any(samples.get(d, {}).get("budget") for d in devices):  # a sample budget M: stored samples against it
        _per_device(left, x, [samples.get(d, {}).get("peak", 0) for d in devices], color="tab:green")
        budgets = [samples.get(d, {}).get("budget") for d in devices]
        left.set_ylabel("samples")
        left.set_title("Peak stored samples and the budget M")
    else:
        _per_device(left, x, [storage.get(d, {}).get("peak", 0) / 1e3 for d in devices], color="tab:green")
        budgets = [(storage.get(d, {}).get("budget") or 0) / 1e3 or None for d in devices]
        left.set_ylabel("kB")
        left.set_title("Peak stored bytes and the budget M")
    drawn = [(i, b) for i, b in enumerate(budgets) if b]
    if drawn:
        left.hlines([b for _, b in drawn], [i - 0.45 for i, _ in drawn], [i + 0.45 for i, _ in drawn],
                    color="tab:red", lw=2, label="budget M")
        left.legend(fontsize="small", loc="lower right")
    for offset, key, colour in ((-0.2, "sent", "tab:blue"), (0.2, "received", "tab:orange")):
        _per_device(right, x, [traffic.get(d, {}).get(key, 0) / 1e6 for d in devices], offset=offset, width=0.4,
                    color=colour, label=key)
    right.set_ylabel("MB")
    right.set_title("MQTT traffic per device")
    right.margins(y=0.15)
    right.legend(fontsize="small", ncols=2, loc="upper left")
    for ax in (left, right):
        _device_axis(ax, devices)
    fig.savefig(path, dpi=120)
    return path


def _plot_iaa(history: Sequence[Mapping[str, Any]], path: Path) -> Path:
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    clients: dict[str, list[tuple[int, float]]] = {}
    for entry in history:
        for device, accuracy in entry.get("client_accuracy", {}).items():
            clients.setdefault(device, []).append((entry["round"], accuracy))
    for i, points in enumerate(clients.values()):
        ax.plot(*zip(*points), color="grey", lw=0.7, alpha=0.6, label="a client" if i == 0 else None)
    ax.plot(*_round_iaa({"history": history}), color="black", lw=2, marker="o", markersize=3, label="IAA")
    ax.legend(fontsize="small")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy on the client's seen test parts")
    ax.set_title("Instant average accuracy (IAA) and each client's accuracy per round")
    fig.savefig(path, dpi=120)
    return path


def _plot_comparison(labels: Sequence[str], runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    with_iaa = [(label, results) for label, results in zip(labels, runs) if results.get("iaa")]
    fig = _figure(14 if with_iaa else 8, 4.5)
    axes = fig.subplots(1, 2) if with_iaa else [fig.add_subplot()]
    curves = [(_round_accuracy, list(zip(labels, runs)), "mean accuracy over seen tasks",
               "Global model accuracy per round"),
              (_round_iaa, with_iaa, "IAA", "Instant average accuracy per round")][: len(axes)]
    for ax, (curve, shown, ylabel, title) in zip(axes, curves):
        for label, results in shown:
            ax.plot(*curve(results), marker="o", markersize=3, label=label,
                    drawstyle="steps-post" if _evaluated_only(results["history"]) else "default")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


# --- entry points -------------------------------------------------------------------------------------------

def write_report(folder: str | Path, results: Mapping[str, Any] | None = None) -> list[Path]:
    """Write summary.md, accuracy_matrix.png, accuracy_per_task.png, storage_traffic.png and, for a run with IAA,
    iaa.png into the run folder (`results` defaults to the folder's results.json). Returns the written paths,
    summary.md first."""
    folder = Path(folder)
    results = load_run(folder) if results is None else results
    summary = run_summary(results)
    markdown = folder / "summary.md"
    markdown.write_text(_summary_markdown(results.get("label") or folder.resolve().name, results, summary,
                                          load_fleet(folder)))
    return [
        markdown,
        _plot_matrix(summary["accuracy_matrix"], folder / "accuracy_matrix.png"),
        _plot_per_task(results, folder / "accuracy_per_task.png", _described(results["scenario"])[1]),
        _plot_devices(summary, folder / "storage_traffic.png"),
        *([_plot_iaa(results["history"], folder / "iaa.png")] if summary["iaa"] is not None else []),
    ]


def compare_runs(folders: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> list[Path]:
    """Write out/comparison.md (one row per run; AA and AFM columns where a run has IAA) and out/comparison.png
    (mean accuracy over seen tasks per round, one line per run; beside it IAA per round where a run has it).
    Labels default to each run's label, else its folder name. Returns both paths."""
    runs = [load_run(f) for f in folders]
    if labels is None:
        labels = [r.get("label") or Path(f).resolve().name for f, r in zip(folders, runs)]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs: give one label per run folder")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = out / "comparison.md"
    markdown.write_text(_comparison_markdown(labels, runs, [run_summary(r) for r in runs],
                                             [load_fleet(f) for f in folders]))
    return [markdown, _plot_comparison(labels, runs, out / "comparison.png")]


def _run_report(args: argparse.Namespace) -> int:
    try:
        if len(args.runs) == 1:
            if args.out or args.labels:
                raise ValueError("--out and --labels apply to a comparison of several run folders")
            paths = write_report(args.runs[0])
        else:
            out = args.out or Path(args.runs[0]).resolve().parent / "comparison"
            paths = compare_runs(args.runs, out, args.labels)
    except (OSError, ValueError) as err:
        print(f"edgefil report: {err}", file=sys.stderr)
        return 2
    print(paths[0].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_report_parser(commands: argparse._SubParsersAction) -> None:
    """Add `edgefil report DIR [DIR ...] [--out DIR] [--labels a,b,c]` to the `edgefil` command's subparsers."""
    report = commands.add_parser(
        "report", help="summary.md and plots of a run folder; with several folders, a comparison table and plot"
    )
    report.add_argument("runs", nargs="+", metavar="DIR", help="run folders, each holding results.json")
    report.add_argument("--out", help="folder for the comparison (default: the first DIR's parent / comparison)")
    report.add_argument("--labels", type=lambda text: text.split(","),
                        help="comma-separated run names for the comparison (default: the folder names)")
    report.set_defaults(run=_run_report)
