"""`glfc`: GLFC's coordinator half (spec: shared/specs/glfc.md, Sec. 4.2): FedAvg, and the proxy server.

Aggregation is unweighted FedAvg of the round's models (the authors' code; `weighted = true` weighs by samples).
Every round names the fleet's classes to the devices (`known_classes`): GLFC's head is one sigmoid per class of the
tasks so far (edge_client/policies/glfc.py). The proxy (`proxy = true`; false is the paper's "w/o PRS" ablation,
GLFC without it):

1. pools the round's prototype gradients (`glfc/prototype/<k>` attachments, checked in `inspect`; a device
   uploads them in its first round of a task, so they come over the task's rounds), ordered by a hash of each
   gradient keyed with the seed and the task (no gradient is tied to its device once pooled, the same updates give
   the same pool on any host, and a device's gradients leaving the pool change which others are kept by as many
   as it had, which central DP's bound needs); at most `max_reconstructions` of a task (the rest are counted, not
   used).
   A device's gradients count only as far as an honest device's would, so one device cannot crowd the pool or
   outvote the others' labels: once a task (its first update that carries any), one per class of the task's
   (`task_classes`; every class where the round does not name them), each of a class its label (read as in 2)
   does not repeat; the rest are counted (`prototypes_refused`), not used;
2. infers each one's label from the last layer's gradient (`models.glfc.infer_label`);
3. reconstructs one sample per gradient by gradient matching (Eqs. 8-9): x ~ N(0, 1), L-BFGS on
   sum_i ||grad_W_i CE(Gamma(x), y) - grad_W_i||^2 (`lbfgs_iterations` per sample, `lbfgs_lr`, a strong Wolfe
   line search), clamped to `input_range` at the end (one that is not finite, as a finite but extreme gradient
   gives, is dropped and logged), in a `BackgroundJob` on the strategy's torch device (cuda
   when present), so the coordinator keeps handling its devices meanwhile; an empty pool starts nothing (the
   authors' code divides by zero there). Its work is bounded by counts (reconstructions x iterations), not by
   time, so what it reconstructs is the same on a quiet and a loaded host;
4. at the last round of a task, waits (off the loop: a `Pending` round, the coordinator serving its devices
   meanwhile) until every pooled gradient of the task is reconstructed, then scores every global model of the task
   on the monitor set (top-1 over the classes seen) and keeps the best, the latest on a tie as the authors' `>=`
   (the score is reset at each task; the authors' code never resets it, so a later task's model must beat an
   earlier task's score). The choice waits for the whole monitor set, so it does not depend on how fast the proxy
   ran. The monitor set (`monitor`) is the paper's, "task": the task's reconstructions, prototypes of its new
   classes (Sec. 4.2: S_P "reconstructs N_g^t prototype samples of new classes ... forwards these reconstructed
   samples into the global model ... to select the best"); with it the latest model of the task nearly always
   wins, because a task's rounds only improve its new classes. "seen" (ours, not the paper's) keeps every task's
   reconstructions, so old classes are scored too and a model that forgot them can lose: the paper motivates the
   proxy by "the best memory for all old classes" but its text scores new classes only;
5. broadcasts the task's best model (`glfc/old-model`, `glfc/old-task`) to every device, once, with the task's last
   round (coordinator/broadcast.py): the old model the devices distil from in the next task. Without
   reconstructions for the task, the best model is the task's last global model (as without the proxy).

Under central DP (coordinator/privacy.py) every round's model is released inside the rule, before the proxy
keeps it, so the task's models it scores and the old model it broadcasts are released ones. The choice itself
reads the devices' gradients: it is report-noisy-max, the argmax of each model's count of monitor samples right
plus Gaussian noise of sd z x s sqrt(J), J the task's models and s = one device's most samples in the monitor set
(one per class of the task, as `_honest_share` takes them; every class where the round names none), so that the
noisy counts are a Gaussian mechanism of multiplier z, counted at rate 1 once a task (`extra_releases`: it reads
the gradients of every device of the task). The argmax of released counts is post-processing. The paper's monitor
only: "seen" lets a device's share grow with the tasks, and is refused. The reconstructions stay on the
coordinator (trusted under central DP), as the metrics do.

`reconstruction_timeout_s` is a safeguard, not a budget: a task's reconstructions not done by then (a GPU-sized
job on a small CPU) are cut short with an error in the log, and the choice is then the machine's.

Gamma is the registered model `gamma` built from `gamma_seed`, the same network the devices' policy exports.
Running the proxy as a process of its own (the paper's separate role) would take: a subscription to the devices'
update topics filtered to their `glfc/prototype/*` attachments (or devices sending them on a topic of their own,
which the broker's ACL would grant), the global models (the `all/weights` broadcast it can read), and a topic to
hand the coordinator its best model; the coordinator would relay it as it relays this rule's broadcast. Nothing
else of the protocol changes.
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from coordinator.background import BackgroundJob, Deadline
from coordinator.privacy import BuiltFrom, Release
from coordinator.strategies.base import (
    OUTSIDE_A_RUN,
    PENDING_MARGIN_S,
    AggregateResult,
    ClientUpdate,
    Pending,
    RefusedUpdate,
    RoundContext,
    Strategy,
    aggregate_by_folding,
)
from coordinator.strategies.fedavg import WeightedFold
from edgefil.durable import npz_bytes, read_npz, write_atomically
from models.flat_weights import load_flat_weights
from models.glfc import (
    GAMMA_AUTO,
    MAX_PROTOTYPES,
    decode_gradient,
    encode_old_model,
    gamma_model,
    infer_label,
    is_prototype,
)
from models.manifest import Manifest, ParameterInfo
from models.zoo import build_for, build_model

log = logging.getLogger("edgefil.coordinator")
STATE_FILE = "glfc.npz"
LBFGS_BURST = 10  # L-BFGS iterations between two looks at the safeguard's deadline
MONITORS = ("task", "seen")


class GlfcProxy(Strategy):
    name = "glfc"
    built_from = BuiltFrom.MEAN  # the global model is FedAvg's; the proxy's choice goes out as the broadcast
    makes_inputs = True  # the proxy's reconstructions, clamped to `input_range`

    @classmethod
    def central_dp_refused(cls, options: Mapping[str, Any]) -> str | None:
        """Central DP runs with the proxy's paper monitor only (module docstring, "Under central DP")."""
        if options.get("monitor", "task") == "seen":
            return ("mode = \"central\" bounds one device's share of the proxy's monitor set by one task's classes: "
                    "glfc's monitor = \"seen\" keeps every task's reconstructions (use monitor = \"task\")")
        return None

    def extra_releases(self, ctx: RoundContext) -> tuple[Release, ...]:
        """The proxy's choice of the task's best model, at its last round: it reads every gradient of the task."""
        return (Release.WHOLE_FLEET,) if self.proxy and ctx.ends_task else ()

    def __init__(
        self,
        proxy: bool = True,
        gamma: str = GAMMA_AUTO,
        gamma_seed: int = 2021,
        lbfgs_iterations: int = 100,
        lbfgs_lr: float = 1.0,
        max_reconstructions: int = 64,
        monitor: str = "task",
        reconstruction_timeout_s: float = 3600.0,
        input_range: tuple[float, float] = (0.0, 1.0),
        weighted: bool = False,
        seed: int = 0,
        device: torch.device | str = "auto",
        manifest: Manifest | None = None,
    ) -> None:
        if manifest is None:
            raise ValueError("strategy 'glfc' needs the model's manifest (the proxy runs the model)")
        super().__init__(device, manifest)
        self.weighted = weighted
        if lbfgs_iterations < 1 or not (math.isfinite(lbfgs_lr) and lbfgs_lr > 0):
            raise ValueError("lbfgs_iterations must be >= 1 and lbfgs_lr a positive number")
        if max_reconstructions < 1:
            raise ValueError(f"max_reconstructions must be >= 1, got {max_reconstructions}")
        if monitor not in MONITORS:
            raise ValueError(f"monitor must be one of {', '.join(MONITORS)}, got {monitor!r}")
        if not (math.isfinite(reconstruction_timeout_s) and reconstruction_timeout_s > 0):
            raise ValueError(f"reconstruction_timeout_s must be > 0, got {reconstruction_timeout_s}")
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise ValueError(f"input_range must be [low, high] with low < high, got {input_range}")
        self.proxy, self.lbfgs_iterations, self.lbfgs_lr = proxy, lbfgs_iterations, lbfgs_lr
        self.max_reconstructions, self.monitor_kind = max_reconstructions, monitor
        self.timeout_s, self.input_range, self.seed = reconstruction_timeout_s, (low, high), seed
        self.manifest: Manifest = manifest
        self.shape = tuple(manifest.input_shape)
        self.num_classes = manifest.num_classes
        self.gamma = build_model(gamma_model(gamma, self.shape), manifest.num_classes, self.shape,
                                 seed=gamma_seed).to(self.device).eval()
        self.gamma_parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in self.gamma.named_parameters())
        self.model = build_for(manifest).to(self.device).eval()
        self.job: BackgroundJob[tuple[int, np.ndarray, np.ndarray]] = BackgroundJob("glfc-proxy")
        self.choice: BackgroundJob[AggregateResult] = BackgroundJob("glfc-proxy-choice")
        self.waiting: tuple[int, list[np.ndarray]] | None = None  # (task, gradients) pooled, not yet started
        self.pooled: tuple[int, int] = (-1, 0)  # (task, gradients of it pooled so far), for the cap
        self.contributed: tuple[int, set[str]] = (-1, set())  # (task, devices whose gradients of it were taken)
        self.monitor: tuple[int, np.ndarray, np.ndarray] | None = None  # (task, x, y) reconstructed
        self.task_models: tuple[int, list[np.ndarray]] = (-1, [])  # the task's global models so far
        self.last_metrics: dict[str, float] = {}

    # --- checks ---------------------------------------------------------------------------------

    def inspect(self, update: ClientUpdate) -> None:
        """Only prototype gradients, at most MAX_PROTOTYPES, each exactly Gamma's parameters and finite."""
        names = list(update.attachments)
        if len(names) > MAX_PROTOTYPES:
            raise RefusedUpdate("attachments", f"{len(names)} prototype gradients, at most {MAX_PROTOTYPES}")
        for name in names:
            if not is_prototype(name):
                raise RefusedUpdate("attachments", f"unknown attachment {name!r}")
            try:
                decode_gradient(bytes(update.attachments[name]), self.gamma_parameters)
            except ValueError as err:
                raise RefusedUpdate("prototype", f"{name}: {err}") from None

    # --- the round ------------------------------------------------------------------------------

    def configure(self, ctx: RoundContext, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Every round names the fleet's classes: the devices' heads cover them (Eq. 1)."""
        return {device: {"known_classes": True} for device in devices}

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult | Pending:
        result = aggregate_by_folding(WeightedFold(global_weights, self.weighted, self.device), updates)
        if ctx.privacy is not None:  # the task's models, which the proxy scores and sends on, are the released ones
            result.global_weights = torch.from_numpy(ctx.privacy.release(result.global_weights.cpu().numpy()))
        weights = result.global_weights.detach().cpu().numpy().astype(np.float32)
        self.last_metrics = {}
        task, models = self.task_models
        self.task_models = (ctx.task, ([] if task != ctx.task or ctx.starts_task else models) + [weights])
        if self.proxy:
            self._pool(updates, ctx)
            self._take_reconstruction()
            self._start_reconstruction()
        if not ctx.ends_task:
            return self._with_metrics(result)
        if not self.proxy:
            result.broadcast = encode_old_model(weights, ctx.task)
            return result

        def choose(deadline: Deadline) -> AggregateResult:
            self._finish_reconstructions(deadline)
            result.broadcast = encode_old_model(self._choose(ctx), ctx.task)
            return self._with_metrics(result)

        if not self.choice.start(choose, self.timeout_s):
            raise RuntimeError("the previous task's choice of its best model still runs")
        return Pending(self.choice, self.timeout_s + PENDING_MARGIN_S)

    def _with_metrics(self, result: AggregateResult) -> AggregateResult:
        if self.last_metrics:
            result.metrics = {"proxy": dict(self.last_metrics)}
        return result

    def _pool(self, updates: Sequence[ClientUpdate], ctx: RoundContext) -> None:
        """The round's prototype gradients, each device's as far as an honest device's go (`_honest_share`), in
        device order and shuffled (seeded by the task and the gradients pooled before), join those waiting for a
        reconstruction, up to `max_reconstructions` a task (a new task's replace an earlier task's that never
        started)."""
        task = ctx.task
        contributed = self.contributed[1] if self.contributed[0] == task else set()
        pool: list[np.ndarray] = []
        refused = 0
        for update in sorted(updates, key=lambda u: u.device):
            gradients = [decode_gradient(bytes(data), self.gamma_parameters)
                         for name, data in sorted(update.attachments.items()) if is_prototype(name)]
            if not gradients:
                continue
            taken = [] if update.device in contributed else self._honest_share(gradients, ctx.task_classes)
            contributed.add(update.device)
            pool.extend(taken)
            refused += len(gradients) - len(taken)
        self.contributed = (task, contributed)
        if refused:
            self.last_metrics["prototypes_refused"] = float(refused)
        if not pool:
            return
        earlier = self.pooled[1] if self.pooled[0] == task else 0
        key = f"{self.seed}/{task}".encode()
        order = sorted(range(len(pool)), key=lambda i: hashlib.blake2b(pool[i].tobytes(), key=key).digest())
        room = max(self.max_reconstructions - earlier, 0)
        kept = [pool[i] for i in order[:room]]
        self.pooled = (task, earlier + len(kept))
        self.last_metrics["prototypes_pooled"] = float(len(pool))
        if len(kept) < len(pool):
            self.last_metrics["prototypes_over_the_cap"] = float(len(pool) - len(kept))
        if not kept:
            return
        waiting = self.waiting[1] if self.waiting is not None and self.waiting[0] == task else []
        self.waiting = (task, waiting + kept)

    def _honest_share(self, gradients: Sequence[np.ndarray], task_classes: Sequence[int]) -> list[np.ndarray]:
        """What an honest device sends of a task: one gradient per class of the task (of its new classes), so at
        most one whose label is each class of `task_classes` (any class where the round names none)."""
        allowed = set(task_classes) or set(range(self.num_classes))
        taken: dict[int, np.ndarray] = {}
        for gradient in gradients:
            label = infer_label(gradient, self.gamma_parameters)
            if label in allowed and label not in taken:
                taken[label] = gradient
        return list(taken.values())

    def _start_reconstruction(self) -> None:
        """Reconstruct what waits, unless a reconstruction runs."""
        if self.waiting is None or self.job.running:
            return
        task, gradients = self.waiting
        if self.job.start(lambda deadline: (task, *self.reconstruct(gradients, deadline)), self.timeout_s):
            self.waiting = None

    def _take_reconstruction(self) -> None:
        """A finished reconstruction joins the monitor set: its task's, or (`monitor = "seen"`) every task's."""
        done = self.job.take()
        if done is None or not len(done[2]):
            return
        task, x, y = done
        if self.monitor is not None and (self.monitor[0] == task or self.monitor_kind == "seen"):
            x, y = np.concatenate([self.monitor[1], x]), np.concatenate([self.monitor[2], y])
        self.monitor = (task, x, y)
        self.last_metrics["reconstructions"] = float(len(y))

    def _finish_reconstructions(self, deadline: Deadline) -> None:
        """Until every pooled gradient of the task is reconstructed (or the safeguard's deadline passes)."""
        while self.job.running or self.waiting is not None:
            if not self.job.wait(deadline.left()) or deadline.passed():
                log.error("glfc proxy: the task's reconstructions were not done within reconstruction_timeout_s = "
                          "%g s; its best model is chosen on those done (a choice of this machine's speed)",
                          self.timeout_s)
                break
            self._take_reconstruction()
            self._start_reconstruction()
        self._take_reconstruction()

    def _choose(self, ctx: RoundContext) -> np.ndarray:
        """The task's best global model on the monitor set (most samples right, with noise under central DP), the
        latest of the best; the last model without one."""
        models = self.task_models[1]
        if self.monitor is None or (self.monitor[0] != ctx.task and self.monitor_kind == "task"):
            return models[-1]
        _, x, y = self.monitor
        scores = np.array([self.correct(model, x, y, ctx.seen_classes) for model in models], dtype=np.float64)
        if ctx.privacy is not None:  # one device moves each count by at most its share of the monitor set
            share = len(ctx.task_classes) or self.num_classes
            scores = ctx.privacy.gaussian(scores, share * math.sqrt(len(models)), Release.WHOLE_FLEET)
        top = max(range(len(scores)), key=lambda i: (scores[i], i))
        self.last_metrics.update(reconstruction_accuracy=scores[-1] / len(y), best_accuracy=scores[top] / len(y),
                                 best_round_of_task=float(top + 1), monitor_samples=float(len(y)))
        return models[top]

    def correct(self, weights: np.ndarray, x: np.ndarray, y: np.ndarray, classes: Sequence[int]) -> int:
        """How many of the samples x the model predicts as y (top-1 over `classes`; every class where none)."""
        load_flat_weights(self.model, self.manifest, weights)
        mask = torch.zeros(self.num_classes, device=self.device)
        mask[list(classes) or list(range(self.num_classes))] = 1.0
        with torch.no_grad():
            logits, _ = self.model(torch.from_numpy(x).to(self.device), mask)
        return int((logits.argmax(1).cpu().numpy() == y).sum())

    # --- the proxy's reconstruction -------------------------------------------------------------

    def reconstruct(self, gradients: Sequence[np.ndarray], deadline: Deadline) -> tuple[np.ndarray, np.ndarray]:
        """One sample per gradient by gradient matching (module docstring, 3), each from its own seeded start."""
        samples: list[np.ndarray] = []
        labels: list[int] = []
        dropped = 0
        for gradient in gradients:
            if deadline.passed():
                log.error("glfc proxy: out of time (reconstruction_timeout_s) after %d of %d reconstructions",
                          len(samples), len(gradients))
                break
            label = infer_label(gradient, self.gamma_parameters)
            start = int.from_bytes(hashlib.blake2b(gradient.tobytes(), digest_size=4).digest(), "little")
            generator = torch.Generator().manual_seed(self.seed * 7919 + start)
            sample = self.invert(gradient, label, generator, deadline)
            if not np.isfinite(sample).all():  # an extreme gradient's distance overflows: nothing to score with
                dropped += 1
                continue
            samples.append(sample)
            labels.append(label)
        if dropped:
            log.warning("glfc proxy: %d of %d reconstructions not finite, dropped", dropped, len(gradients))
        if not samples:
            return np.zeros((0, *self.shape), np.float32), np.zeros(0, np.int64)
        return np.stack(samples).astype(np.float32), np.asarray(labels, dtype=np.int64)

    def invert(self, gradient: np.ndarray, label: int, generator: torch.Generator, deadline: Deadline) -> np.ndarray:
        """L-BFGS (strong Wolfe line search) from N(0, 1) on the squared distance between the gradient at x and
        `gradient`, in bursts of LBFGS_BURST iterations with the safeguard's deadline checked between them; clamped
        to the input range at the end (clamping between iterations breaks L-BFGS's curvature pairs: it then
        stalls)."""
        parameters = list(self.gamma.parameters())
        pieces = torch.from_numpy(gradient).to(self.device).split([p.numel() for p in parameters])
        target = [t.reshape(p.shape) for t, p in zip(pieces, parameters)]
        y = torch.tensor([label], device=self.device)
        x = torch.randn(1, *self.shape, generator=generator).to(self.device).requires_grad_(True)
        optimizer = torch.optim.LBFGS([x], lr=self.lbfgs_lr, max_iter=LBFGS_BURST, history_size=100,
                                      line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-14)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            logits, _ = self.gamma(x)
            grads = torch.autograd.grad(F.cross_entropy(logits, y), parameters, create_graph=True)
            distance = torch.stack([((g - t) ** 2).sum() for g, t in zip(grads, target)]).sum()
            distance.backward()
            return distance

        for _ in range(-(-self.lbfgs_iterations // LBFGS_BURST)):
            if deadline.passed():
                break
            optimizer.step(closure)
        low, high = self.input_range
        return x.detach().clamp(low, high).cpu().numpy()[0]

    # --- across a resume ------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """The monitor set, the task's global models so far, how many of its gradients were pooled and whose
        (gradients pooled but not reconstructed when the coordinator stops are lost)."""
        arrays: dict[str, Any] = {"pooled": np.asarray(self.pooled, dtype=np.int64),
                                  "contributed_task": np.int64(self.contributed[0]),
                                  "contributed": np.asarray(sorted(self.contributed[1]), dtype=str)}
        if self.monitor is not None:
            arrays.update(monitor_task=np.int64(self.monitor[0]), monitor_x=self.monitor[1], monitor_y=self.monitor[2])
        if self.task_models[1]:
            arrays.update(models_task=np.int64(self.task_models[0]), models=np.stack(self.task_models[1]))
        write_atomically(directory / STATE_FILE, npz_bytes(arrays))

    def load(self, directory: Path) -> None:
        path = directory / STATE_FILE
        if not path.exists():
            return
        saved = read_npz(path)
        if "pooled" in saved and saved["pooled"].shape == (2,):
            task, count = saved["pooled"].tolist()
            self.pooled = (int(task), int(count))
        if "contributed_task" in saved and saved["contributed"].dtype.kind == "U":
            self.contributed = (int(saved["contributed_task"]), set(saved["contributed"].tolist()))
        if "monitor_task" in saved:
            self.monitor = (int(saved["monitor_task"]), saved["monitor_x"].astype(np.float32),
                            saved["monitor_y"].astype(np.int64))
        if "models_task" in saved and saved["models"].ndim == 2 and \
                saved["models"].shape[1] == self.manifest.num_parameters:
            self.task_models = (int(saved["models_task"]), list(saved["models"].astype(np.float32)))
