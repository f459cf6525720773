"""Run metrics, defined once, as pure functions over plain numbers.

Continual learning: `acc[i, j]` is the accuracy on task j's test set after task i (square; entries j > i are
never read, so `accuracy_matrix` fills them with NaN). Federated: Re-Fed's rounds to the best accuracy and
pFedGRP's IAA/AA/AFM (Eqs. 9-11). Devices: traffic and peak storage against a budget."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def accuracy_matrix(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """Square matrix from the ragged rows of `results.json` (row i: tasks 0..i); NaN marks the unread entries."""
    acc = np.full((len(rows), len(rows)), np.nan)
    for i, row in enumerate(rows):
        if len(row) != i + 1:
            raise ValueError(f"row {i} of an accuracy matrix holds tasks 0..{i} ({i + 1} entries), got {len(row)}")
        acc[i, : i + 1] = row
    return acc


def check_matrix(acc: np.ndarray) -> np.ndarray:
    """`acc` as float64, refused unless square with finite entries on and below the diagonal."""
    acc = np.asarray(acc, dtype=np.float64)
    if acc.ndim != 2 or acc.shape[0] != acc.shape[1]:
        raise ValueError(f"an accuracy matrix is square (tasks x tasks), got shape {acc.shape}")
    if not np.isfinite(acc[np.tril_indices(acc.shape[0])]).all():
        raise ValueError("an accuracy matrix has finite entries on and below the diagonal")
    return acc


def average_accuracy(acc: np.ndarray, after: int | None = None) -> float:
    """Mean accuracy over the tasks seen so far, after task `after` (default: the last, i.e. the final accuracy)."""
    acc = check_matrix(acc)
    t = acc.shape[0] - 1 if after is None else after
    return float(acc[t, : t + 1].mean())


def average_incremental_accuracy(acc: np.ndarray) -> float:
    """The mean over tasks of `average_accuracy` after each task: what results.json and the reports call the
    average accuracy (the final accuracy is `average_accuracy` after the last task)."""
    acc = check_matrix(acc)
    return float(np.mean([average_accuracy(acc, after=t) for t in range(acc.shape[0])]))


LAST_ROUNDS = 10  # Re-Fed reports the final accuracy averaged over the last 10 rounds (spec section 4)


@dataclass(frozen=True)
class LastRounds:
    """The mean accuracy over a run's last rounds, their spread (np.std over the rounds) and how many there were."""

    mean: float
    std: float
    rounds: int


def last_rounds_accuracy(history: Sequence[Mapping[str, Any]], rounds: int = LAST_ROUNDS) -> LastRounds:
    """The final accuracy as the papers report it: over the last `rounds` rounds of the last task in `history`
    (the coordinator's per-round list: "task", and "accuracy" on tasks 0..task), each round's mean accuracy on the
    tasks seen, averaged; with the spread of those rounds (np.std) and how many there were. Only the last task's
    rounds count, since an earlier task's round is measured on fewer tasks; a task with fewer rounds than asked
    gives them all ("rounds" says how many). `rounds` >= 1; an empty history is refused."""
    if rounds < 1:
        raise ValueError(f"the last-rounds mean takes at least one round, got {rounds}")
    if not history:
        raise ValueError("the last-rounds mean needs at least one round")
    last_task = history[-1]["task"]
    tail = [float(np.mean(entry["accuracy"])) for entry in history if entry["task"] == last_task][-rounds:]
    return LastRounds(float(np.mean(tail)), float(np.std(tail)), len(tail))


def forgetting(acc: np.ndarray) -> float:
    """Mean over the earlier tasks of (best accuracy ever reached on it) - (accuracy after the last task)."""
    acc = check_matrix(acc)
    last = acc.shape[0] - 1
    if last == 0:
        return 0.0
    return float(np.mean([acc[j:last, j].max() - acc[last, j] for j in range(last)]))


def backward_transfer(acc: np.ndarray) -> float:
    """Mean over the earlier tasks of (accuracy after the last task) - (accuracy right after learning it)."""
    acc = check_matrix(acc)
    last = acc.shape[0] - 1
    if last == 0:
        return 0.0
    return float(np.mean([acc[last, j] - acc[j, j] for j in range(last)]))


def rounds_to_best(history: Sequence[Mapping[str, Any]], n_tasks: int) -> list[int | None]:
    """Re-Fed's CoR (Table 3): per task t, the rounds from the start of task t until the global model's accuracy
    on task t reached its best among task t's own rounds (1 = best in the task's first round). Ties go to the
    first round reaching the best, so a plateau does not count as slower convergence. None: no rounds for t.

    `history` is the coordinator's per-round list in round order: "task" and "accuracy" (tasks 0..task)."""
    counts: list[int | None] = []
    for t in range(n_tasks):
        curve = [entry["accuracy"][t] for entry in history if entry["task"] == t]
        counts.append(int(np.argmax(curve)) + 1 if curve else None)
    return counts


@dataclass(frozen=True)
class TaskDetection:
    """How devices that were not told where tasks start found them (`task_detection`): of the true boundaries
    (a device's first round on a later task's data), how many its detectors caught at once, how many later, and
    how many tasks it started where none began; `delay_rounds` is the mean of the device's own rounds from a
    boundary to its start, over those caught (0: at once)."""

    boundaries: int
    at_once: int
    later: int
    missed: int
    false_starts: int
    delay_rounds: float

    @property
    def rate(self) -> float:
        """The share of boundaries caught at once (1.0 when there are none)."""
        return self.at_once / self.boundaries if self.boundaries else 1.0


def task_detection(history: Sequence[Mapping[str, Any]]) -> TaskDetection:
    """`TaskDetection` of a run's history: each round's task, and each device's `task_started` metric (1 where its
    learner started a task in that round). A device's first round starts its first task (no boundary); after it, a
    boundary is a round whose task differs from the device's round before; a start in a round of the same task as
    the one before is a false start, the first start after a missed boundary (within the same task) a late
    catch."""
    rounds: dict[str, list[tuple[int, bool]]] = {}
    for entry in history:
        for device, metrics in entry.get("metrics", {}).items():
            if "task_started" in metrics:
                rounds.setdefault(device, []).append((int(entry["task"]), metrics["task_started"] > 0))
    boundaries = at_once = later = false_starts = 0
    delays: list[int] = []
    for seen in rounds.values():
        pending: int | None = None  # rounds since a missed boundary, while its task lasts
        for (previous, _), (task, started) in zip(seen, seen[1:]):
            if task != previous:
                boundaries += 1
                pending = None
                if started:
                    at_once += 1
                    delays.append(0)
                else:
                    pending = 0
            elif started and pending is not None:
                later += 1
                delays.append(pending + 1)
                pending = None
            elif started:
                false_starts += 1
            elif pending is not None:
                pending += 1
    missed = boundaries - at_once - later
    return TaskDetection(boundaries, at_once, later, missed, false_starts,
                         float(np.mean(delays)) if delays else 0.0)


def instant_average_accuracy(accuracies: Sequence[float], samples_seen: Sequence[int]) -> float:
    """pFedGRP's IAA^t (Eq. 9): client accuracies at one round weighted by the samples each has seen so far."""
    if len(accuracies) != len(samples_seen):
        raise ValueError(f"one sample count per client accuracy: {len(accuracies)} accuracies, "
                         f"{len(samples_seen)} counts")
    if any(n < 0 for n in samples_seen):
        raise ValueError(f"sample counts are non-negative, got {list(samples_seen)}")
    if not any(n > 0 for n in samples_seen):
        raise ValueError("IAA needs at least one client that has seen a sample")
    return float(np.dot(accuracies, samples_seen) / np.sum(samples_seen))


def average_of_iaa(iaa: Sequence[float]) -> float:
    """pFedGRP's AA (Eq. 10): IAA averaged over all rounds, so early and mid-run accuracy counts too."""
    if len(iaa) == 0:
        raise ValueError("AA needs the IAA of at least one round")
    return float(np.mean(iaa))


def iaa_forgetting(iaa: Sequence[float]) -> float:
    """pFedGRP's AFM (Eq. 11): mean round-to-round IAA drop, rises clipped to 0 (0.0 for a single round)."""
    if len(iaa) == 0:
        raise ValueError("AFM needs the IAA of at least one round")
    if len(iaa) == 1:
        return 0.0
    return float(np.mean(np.maximum(0.0, -np.diff(np.asarray(iaa, dtype=np.float64)))))


def traffic_summary(bytes_sent: Mapping[str, int], bytes_received: Mapping[str, int]) -> dict[str, Any]:
    """Bytes each device sent and received (0 where a device is missing from one side) and the fleet's totals."""
    devices = sorted(set(bytes_sent) | set(bytes_received))
    per_device = {d: {"sent": bytes_sent.get(d, 0), "received": bytes_received.get(d, 0)} for d in devices}
    return {
        "devices": per_device,
        "sent": sum(p["sent"] for p in per_device.values()),
        "received": sum(p["received"] for p in per_device.values()),
    }


def peak_storage(samples: Mapping[str, Sequence[int]], budget: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Per device: the peak of its stored-byte readings (0 with none) and whether it stayed within its budget,
    reported rather than raised so that one run shows every device that went over."""
    summary: dict[str, dict[str, Any]] = {}
    for device, readings in samples.items():
        peak = max(readings, default=0)
        summary[device] = {"peak": peak, "budget": budget[device], "within_budget": peak <= budget[device]}
    return summary
