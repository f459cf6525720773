"""`glfc`: GLFC's coordinator half (spec: shared/specs/glfc.md, Sec. 4.2): FedAvg, and the proxy server.

Aggregation is unweighted FedAvg of the round's models (the authors' code; `weighted = true` weighs by samples).
The proxy (`proxy = true`; false is the paper's "w/o PRS" ablation, GLFC without it):

1. pools the round's prototype gradients (`glfc/prototype/<k>` attachments, checked in `inspect`; a device
   uploads them in its first round of a task, so they come over the task's rounds) and shuffles them, so no
   gradient is tied to its device once pooled; gradients that arrive while a reconstruction runs wait for it;
2. infers each one's label from the last layer's gradient (`models.glfc.infer_label`);
3. reconstructs one sample per gradient by gradient matching (Eqs. 8-9): x ~ N(0, 1), L-BFGS on
   sum_i ||grad_W_i CE(Gamma(x), y) - grad_W_i||^2 (`lbfgs_iterations` per sample, `lbfgs_lr`, a strong Wolfe
   line search), clamped to `input_range` at the end, all of it in a `BackgroundJob` with
   `reconstruction_budget_s` of wall time, on the strategy's torch device (cuda when present), so the coordinator
   keeps handling its devices meanwhile; an empty pool starts nothing (the authors' code divides by zero there);
4. keeps the task's reconstructions (each finished one joins them), scores every round's global model of the task
   on them (top-1 over the classes seen; a model that came before the reconstructions were ready is scored when
   they are, so the choice does not depend on how fast the proxy ran) and keeps the best one of the task, the
   latest on a tie as the authors' `>=` (the best score is reset at each task; the authors' code never resets it,
   so a later task's model must beat an earlier task's score);
5. at the last round of a task (after waiting up to `wait_at_task_end_s` for the task's reconstructions, the
   waiting ones included: 0, the default, never holds the coordinator's loop; a benchmark that must not depend on
   the machine's speed waits), broadcasts the task's best model (`glfc/old-model`, `glfc/old-task`) to every
   device, once (coordinator/broadcast.py): the old model the devices distil from in the next task. Without
   reconstructions for the task, the best model is the task's last global model (as without the proxy).

Gamma is the registered model `gamma` built from `gamma_seed`, the same network the devices' policy exports.
Running the proxy as a process of its own (the paper's separate role) would take: a subscription to the devices'
update topics filtered to their `glfc/prototype/*` attachments (or devices sending them on a topic of their own,
which the broker's ACL would grant), the global models (the `all/weights` broadcast it can read), and a topic to
hand the coordinator its best model; the coordinator would relay it as it relays this rule's broadcast. Nothing
else of the protocol changes.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from coordinator.background import BackgroundJob, Deadline
from coordinator.strategies.base import OUTSIDE_A_RUN, AggregateResult, ClientUpdate, RefusedUpdate, RoundContext
from coordinator.strategies.fedavg import FedAvg
from edgefil.durable import npz_bytes, write_atomically
from models.flat_weights import load_flat_weights
from models.glfc import MAX_PROTOTYPES, decode_gradient, encode_old_model, infer_label, is_prototype
from models.manifest import Manifest, ParameterInfo
from models.zoo import build_model

log = logging.getLogger("edgefil.coordinator")
STATE_FILE = "glfc.npz"
LBFGS_BURST = 10  # L-BFGS iterations between two looks at the deadline


class GlfcProxy(FedAvg):
    name = "glfc"

    def __init__(
        self,
        proxy: bool = True,
        gamma: str = "glfc_lenet",
        gamma_seed: int = 2021,
        lbfgs_iterations: int = 100,
        lbfgs_lr: float = 1.0,
        reconstruction_budget_s: float = 120.0,
        wait_at_task_end_s: float = 0.0,
        input_range: tuple[float, float] = (0.0, 1.0),
        weighted: bool = False,
        seed: int = 0,
        device: torch.device | str = "auto",
        manifest: Manifest | None = None,
    ) -> None:
        if manifest is None:
            raise ValueError("strategy 'glfc' needs the model's manifest (the proxy runs the model)")
        super().__init__(weighted=weighted, device=device, manifest=manifest)
        if lbfgs_iterations < 1 or not (math.isfinite(lbfgs_lr) and lbfgs_lr > 0):
            raise ValueError("lbfgs_iterations must be >= 1 and lbfgs_lr a positive number")
        if not (math.isfinite(reconstruction_budget_s) and reconstruction_budget_s > 0):
            raise ValueError(f"reconstruction_budget_s must be > 0, got {reconstruction_budget_s}")
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise ValueError(f"input_range must be [low, high] with low < high, got {input_range}")
        self.proxy, self.lbfgs_iterations, self.lbfgs_lr = proxy, lbfgs_iterations, lbfgs_lr
        if not (math.isfinite(wait_at_task_end_s) and wait_at_task_end_s >= 0):
            raise ValueError(f"wait_at_task_end_s must be >= 0, got {wait_at_task_end_s}")
        self.budget_s, self.input_range, self.seed = reconstruction_budget_s, (low, high), seed
        self.wait_at_task_end_s = wait_at_task_end_s
        self.manifest: Manifest = manifest
        self.shape = tuple(manifest.input_shape)
        self.num_classes = manifest.num_classes
        self.gamma = build_model(gamma, manifest.num_classes, self.shape, seed=gamma_seed).to(self.device).eval()
        self.gamma_parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in self.gamma.named_parameters())
        self.model = build_model(manifest.model, manifest.num_classes, self.shape).to(self.device).eval()
        self.job: BackgroundJob[tuple[int, np.ndarray, np.ndarray]] = BackgroundJob("glfc-proxy")
        self.waiting: tuple[int, list[np.ndarray]] | None = None  # (task, gradients) pooled while a job ran
        self.monitor: tuple[int, np.ndarray, np.ndarray] | None = None  # (task, x, y) reconstructed
        self.best: tuple[int, float, np.ndarray] | None = None  # (task, score, weights) of the task's best model
        self.task_models: list[np.ndarray] = []  # the task's global models so far (rounds_per_task at most)
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

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult:
        result = super().aggregate(global_weights, updates, ctx)
        weights = result.global_weights.detach().cpu().numpy().astype(np.float32)
        self.last_metrics = {}
        if self.proxy:
            self._pool(updates, ctx.task)
            self._take_reconstruction()
            self._start_reconstruction()
            if ctx.ends_task and self.wait_at_task_end_s > 0:  # this task's gradients, all of them, first
                deadline = Deadline(self.wait_at_task_end_s)
                while self.job.running or self.waiting is not None:
                    if not self.job.wait(deadline.left()) or deadline.passed():
                        break
                    self._take_reconstruction()
                    self._start_reconstruction()
            self._take_reconstruction()
            self._score(weights, ctx)
        if ctx.ends_task:
            best = self.best[2] if self.best is not None and self.best[0] == ctx.task else weights
            result.broadcast = encode_old_model(best, ctx.task)
        if self.last_metrics:
            result.metrics = {"proxy": dict(self.last_metrics)}
        return result

    def _pool(self, updates: Sequence[ClientUpdate], task: int) -> None:
        """The round's prototype gradients join those waiting for a reconstruction (a new task's replace an
        earlier task's that never started)."""
        pool = [decode_gradient(bytes(data), self.gamma_parameters)
                for update in updates for name, data in sorted(update.attachments.items()) if is_prototype(name)]
        if not pool:
            return
        earlier = self.waiting[1] if self.waiting is not None and self.waiting[0] == task else []
        self.waiting = (task, earlier + pool)
        self.last_metrics["prototypes_pooled"] = float(len(pool))

    def _start_reconstruction(self) -> None:
        """Reconstruct what waits, shuffled (no device order survives), unless a reconstruction runs."""
        if self.waiting is None or self.job.running:
            return
        task, pool = self.waiting
        order = np.random.default_rng(self.seed + task).permutation(len(pool))
        gradients = [pool[i] for i in order]
        if self.job.start(lambda deadline: (task, *self.reconstruct(gradients, deadline)), self.budget_s):
            self.waiting = None

    def _take_reconstruction(self) -> None:
        """A finished reconstruction joins its task's monitor set (a new task's replaces the earlier task's)."""
        done = self.job.take()
        if done is None or not len(done[2]):
            return
        task, x, y = done
        if self.monitor is not None and self.monitor[0] == task:
            x, y = np.concatenate([self.monitor[1], x]), np.concatenate([self.monitor[2], y])
        self.monitor = (task, x, y)
        self.last_metrics["reconstructions"] = float(len(y))

    def _score(self, weights: np.ndarray, ctx: RoundContext) -> None:
        """Every global model of the task so far, scored on the task's reconstructions as they stand now (they
        grow as reconstructions finish, so scores are only compared on one set); the best is kept."""
        if ctx.starts_task or (self.best is not None and self.best[0] != ctx.task):
            self.task_models, self.best = [], None  # reset at each task
        self.task_models.append(weights)
        if self.monitor is None or self.monitor[0] != ctx.task:
            return
        _, x, y = self.monitor
        scores = [self.accuracy(model, x, y, ctx.seen_classes) for model in self.task_models]
        top = max(range(len(scores)), key=lambda i: (scores[i], i))  # the latest of the best, as the authors' >=
        self.best = (ctx.task, scores[top], self.task_models[top])
        self.last_metrics.update(reconstruction_accuracy=scores[-1], best_round_of_task=float(top + 1))

    def accuracy(self, weights: np.ndarray, x: np.ndarray, y: np.ndarray, classes: Sequence[int]) -> float:
        load_flat_weights(self.model, self.manifest, weights)
        mask = torch.zeros(self.num_classes, device=self.device)
        mask[list(classes) or list(range(self.num_classes))] = 1.0
        with torch.no_grad():
            logits, _ = self.model(torch.from_numpy(x).to(self.device), mask)
        return float((logits.argmax(1).cpu().numpy() == y).mean())

    # --- the proxy's reconstruction -------------------------------------------------------------

    def reconstruct(self, gradients: Sequence[np.ndarray], deadline: Deadline) -> tuple[np.ndarray, np.ndarray]:
        """One sample per gradient by gradient matching (module docstring, 3); what the deadline leaves time for."""
        samples: list[np.ndarray] = []
        labels: list[int] = []
        generator = torch.Generator().manual_seed(self.seed)
        for gradient in gradients:
            if deadline.passed():
                log.warning("glfc proxy: out of time after %d of %d reconstructions", len(samples), len(gradients))
                break
            label = infer_label(gradient, self.gamma_parameters)
            samples.append(self.invert(gradient, label, generator, deadline))
            labels.append(label)
        if not samples:
            return np.zeros((0, *self.shape), np.float32), np.zeros(0, np.int64)
        return np.stack(samples).astype(np.float32), np.asarray(labels, dtype=np.int64)

    def invert(self, gradient: np.ndarray, label: int, generator: torch.Generator, deadline: Deadline) -> np.ndarray:
        """L-BFGS (strong Wolfe line search) from N(0, 1) on the squared distance between the gradient at x and
        `gradient`, in bursts of LBFGS_BURST iterations with the deadline checked between them; clamped to the
        input range at the end (clamping between iterations breaks L-BFGS's curvature pairs: it then stalls)."""
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
        arrays: dict[str, Any] = {}
        if self.monitor is not None:
            arrays.update(monitor_task=np.int64(self.monitor[0]), monitor_x=self.monitor[1], monitor_y=self.monitor[2])
        if self.best is not None:
            arrays.update(best_task=np.int64(self.best[0]), best_score=np.float64(self.best[1]),
                          best_weights=self.best[2])
        write_atomically(directory / STATE_FILE, npz_bytes(arrays))

    def load(self, directory: Path) -> None:
        path = directory / STATE_FILE
        if not path.exists():
            return
        with np.load(path, allow_pickle=False) as saved:
            if "monitor_task" in saved.files:
                self.monitor = (int(saved["monitor_task"]), saved["monitor_x"].astype(np.float32),
                                saved["monitor_y"].astype(np.int64))
            if "best_task" in saved.files:
                weights = saved["best_weights"].astype(np.float32)
                if weights.size == self.manifest.num_parameters:
                    self.best = (int(saved["best_task"]), float(saved["best_score"]), weights)
