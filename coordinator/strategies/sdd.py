"""`sdd`: SDD's coordinator half (spec: shared/specs/fewshot-sdd.md, Secs. 2.2-2.4): a conditional generator
trained data-free from the round's local models, class-specific weighted aggregation (CSWA), and the synthetic
replay set every device replays.

A session is a task; its first round (the paper has one round per session) does the session's work:

1. The generator (Eqs. 4-11), after local training and before aggregation, off the coordinator's loop (a
   `Pending` round: the coordinator serves its devices meanwhile), on the strategy's torch device (cuda when
   present). Its work is counted (`generator_epochs` x `generator_iterations` steps), not timed, so what it makes
   is the same on a quiet and a loaded host; `generator_timeout_s` is a safeguard, not a budget (a generator cut
   short by it is an error in the log, and its samples are then the machine's). The teacher O(x) is the plain
   average of the local models' logits over the session's classes; the loss is lambda_ce CE(O(x), y) -
   lambda_entropy H_info(O(x)) + lambda_statistics L_stat + lambda_adversarial L_KL. L_stat compares the synthetic
   batch's statistics with each device's (`models/feature_stats.py`: the input channels', and the penultimate
   features' under that device's model), averaged over the devices that sent them (the zoo's models keep no
   BatchNorm statistics: docs/methods/sdd.md says why and what they reveal). L_KL = -omega KL(O || S) against a
   student S (the classifier's architecture, trained by SGD on KL(O || S)), omega by the paper's sign (1 where
   teacher and student disagree) or TARGET's (`adversarial_sign = "target"`: where they agree), after
   `warmup_epochs` epochs without it. One batch per epoch, the last, joins the session's synthetic set X~_t
   (TARGET keeps one per epoch; the paper's Alg. 2 would keep every batch). Every loss component, the steps and
   the wall time are round metrics (`generator`). What one device sends cannot steer it (issue 56): its
   statistics are used only where an honest device's could be (`plausible_statistics`: inputs within the data's
   range, features within `statistics_factor` of the round's lower median; the rest counted,
   `statistics_refused`), and a generator that made no finite step makes no samples (the session then keeps the
   FedAvg rows and adds nothing to the replay set).
2. CSWA (Eqs. 12-18): everything by sample-weighted FedAvg, then each new class's head row (our heads are
   classes x features, the paper's columns) as sum_m a_m^i w_m^i, a_m^i the accuracy of local model m on
   X~_t's samples of class i (argmax over the classes seen). `aggregation = "cswa-literal"` is Eq. 17 as printed
   (unnormalised: a row's weights sum to sum_m a_m^i, up to the number of devices); "cswa-normalized" divides by
   sum_m a_m^i; either falls back to the FedAvg row for a class every model gets wrong (sum 0). "fedavg" is the
   ablation (SDD without CSWA). The new classes' biases: the paper's W_new = [w_{l,i}] is L x c (Eq. 13), weights
   without a bias, and Eq. 12 averages everything else by samples, so `new_bias = "fedavg"` (the default) averages
   them with W_old; "cswa" scales each with its row (this runtime's reading before issue 55). Each device's row
   first counts at most `row_bound` x the lower median length of the rows that count (`row_lengths_bound`): one
   device cannot scale a new class over the old ones (issue 56).
3. The replay set: X~_t's samples join those of the sessions before, at most `replay_per_class` per class (the
   last ones made, by the best-trained generator), broadcast to every device as `sdd/replay` at the end of the
   session (the devices replay them in the next). At the end of the base session (task 0), the generator is
   trained from the global model alone (Eq. 4, t = 0) for the base classes. Samples, not the generator, travel:
   for digits' 8x8 images a class's 50 samples take 6.5 KB against the generator's 77 KB (both are metrics,
   `replay_bytes` and `generator_bytes`).

Under central DP (coordinator/privacy.py) the replay set every device receives is built from released numbers
alone, so it is post-processing: the generator's one teacher is the mean of the round's clipped models, released
with the model's noise (where the rule is FedAvg, `aggregation = "fedavg"`, that is the round's model itself,
released inside the rule; with CSWA, a further mechanism of the round, since CSWA's rows are what the round
releases), and its statistics term compares with the devices' statistics' noised mean (each device's means and
variances one vector clipped to `statistics_clip_norm`, summed with noise of sd z x that norm, over the selected
count: another mechanism; none with `lambda_statistics = 0`), not with each device's; the plausibility filter, which
judges a device by the round's median, gives way to the clip. Both are counted at the round's sampling rate
(`extra_releases`). CSWA's accuracies come from that X~ and the round's local models: the rows it builds are part of
the global model, which the noise covers as a rule built from more than the mean (calibration "ball"). What this
changes of the paper's method: one teacher (the mean, not the ensemble of the local models) and one set of
statistics (their mean, with noise). What stays on the coordinator (the local models, each device's statistics, the
generator's log) is not released.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from coordinator.background import BackgroundJob, Deadline
from coordinator.medians import RunningMedian
from coordinator.privacy import BuiltFrom, Release, RoundPrivacy
from coordinator.strategies.base import (
    OUTSIDE_A_RUN,
    PENDING_MARGIN_S,
    AggregateResult,
    ClientUpdate,
    Pending,
    RefusedUpdate,
    RoundContext,
    Strategy,
    validate_updates,
)
from coordinator.strategies.fedavg import WeightedFold
from edgefil.durable import npz_bytes, read_npz, write_atomically
from models.feature_stats import LAYERS, STATISTICS, LayerStatistics, decode_statistics, layer_sizes
from models.flat_weights import load_flat_weights
from models.manifest import Manifest, class_head_positions
from models.sdd import REPLAY, encode_replay
from models.sdd_generator import (
    ADVERSARIAL_SIGNS,
    ConditionalGenerator,
    adversarial_mask,
    distillation_kl,
    ensemble_logits,
    information_entropy,
    statistics_distance,
)
from models.zoo import ClassifierModel, build_for, build_model

log = logging.getLogger("edgefil.coordinator")
AGGREGATIONS = ("cswa-literal", "cswa-normalized", "fedavg")
NEW_BIASES = ("fedavg", "cswa")  # how CSWA treats the new classes' biases (module docstring, 2)
STATE_FILE = "sdd.npz"


@dataclass(frozen=True)
class GeneratorSettings:
    """The generator's schedule and loss weights (the spec's Sec. 2.2; the paper: 100 epochs x 50 iterations,
    Adam 1e-3, student SGD 0.2 with momentum 0.9; temperature and warm-up are TARGET's)."""

    epochs: int = 20
    iterations: int = 20
    batch_size: int = 64
    nz: int = 32
    ngf: int = 16
    lr: float = 1e-3
    lambda_ce: float = 1.0
    lambda_entropy: float = 1.0
    lambda_statistics: float = 1.0
    lambda_adversarial: float = 1.0
    adversarial_sign: str = "paper"
    warmup_epochs: int = 5
    temperature: float = 5.0
    student_lr: float = 0.2
    student_steps: int = 1

    def check(self) -> None:
        for name in ("epochs", "iterations", "batch_size", "nz", "ngf", "student_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"generator {name} must be >= 1")
        if self.adversarial_sign not in ADVERSARIAL_SIGNS:
            raise ValueError(f"adversarial_sign must be one of {ADVERSARIAL_SIGNS}, got {self.adversarial_sign!r}")
        if self.lambda_adversarial > 0 and self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs = {self.warmup_epochs} of {self.epochs} epochs: the adversarial term "
                             f"would never run (set lambda_adversarial = 0 to train without it)")
        if min(self.lr, self.student_lr, self.temperature) <= 0 or self.warmup_epochs < 0 or min(
                self.lambda_ce, self.lambda_entropy, self.lambda_statistics, self.lambda_adversarial) < 0:
            raise ValueError("generator rates and temperature must be > 0, loss weights and warm-up >= 0")


@dataclass(frozen=True)
class Synthetic:
    """Synthetic samples (one batch per epoch, in order) and the labels they were generated for, with the
    generator's log and the student it trained against."""

    x: np.ndarray
    y: np.ndarray
    log: dict[str, float]
    student: ClassifierModel | None = None


def train_generator(teachers: Sequence[ClassifierModel], statistics: Sequence[dict[str, LayerStatistics] | None],
                    classes: Sequence[int], settings: GeneratorSettings, manifest: Manifest,
                    input_range: tuple[float, float], device: torch.device, seed: int,
                    deadline: Deadline | None = None, student: ClassifierModel | None = None) -> Synthetic:
    """The module docstring's step 1: a conditional generator for `classes` from the frozen `teachers` (each with
    its device's statistics, or None), within the deadline; the synthetic set is one batch per epoch. The student
    starts as `student` (trained in place), by default the manifest's model initialised afresh (TARGET's)."""
    input_shape, num_classes = tuple(manifest.input_shape), manifest.num_classes
    generator_seed = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generator = ConditionalGenerator(input_shape, num_classes, settings.nz, settings.ngf, input_range).to(device)
        if student is None:
            student = build_model(manifest.model, num_classes, input_shape, args=manifest.model_args)
    student = student.to(device).requires_grad_(True)
    for teacher in teachers:
        teacher.eval().requires_grad_(False)
    session = torch.tensor(list(classes), device=device)
    optimizer = torch.optim.Adam(generator.parameters(), lr=settings.lr)
    student_optimizer = torch.optim.SGD(student.parameters(), lr=settings.student_lr, momentum=0.9)
    stats = [(i, _tensors(s, device)) for i, s in enumerate(statistics) if s is not None]
    totals = dict.fromkeys(("ce", "entropy", "statistics", "adversarial", "student_kl"), 0.0)
    kept_x, kept_y, steps, skipped, started = [], [], 0, 0, time.perf_counter()
    for epoch in range(settings.epochs):
        for _ in range(settings.iterations):
            if deadline is not None and deadline.passed():
                log.error("sdd: the generator was cut short by generator_timeout_s after %d of %d steps: its samples "
                          "are this machine's", steps, settings.epochs * settings.iterations)
                break
            z = torch.randn(settings.batch_size, settings.nz, generator=generator_seed).to(device)
            index = torch.randint(len(classes), (settings.batch_size,), generator=generator_seed).to(device)
            x = generator(z, session[index])
            outputs = [teacher(x) for teacher in teachers]
            ensemble = ensemble_logits([logits[:, session] for logits, _ in outputs])
            ce = F.cross_entropy(ensemble, index)
            entropy = information_entropy(ensemble)
            statistics_term = torch.zeros((), device=device)
            for i, layers in stats:
                statistics_term = statistics_term + statistics_distance(x, *layers["input"]) \
                    + statistics_distance(outputs[i][1], *layers["features"])
            statistics_term = statistics_term / max(len(stats), 1)
            adversarial = torch.zeros((), device=device)
            if epoch >= settings.warmup_epochs and settings.lambda_adversarial > 0:
                student.eval()
                s_logits = student(x)[0][:, session]
                omega = adversarial_mask(ensemble.detach(), s_logits.detach(), settings.adversarial_sign)
                adversarial = -(omega * distillation_kl(ensemble, s_logits, settings.temperature)).mean()
            loss = settings.lambda_ce * ce - settings.lambda_entropy * entropy \
                + settings.lambda_statistics * statistics_term + settings.lambda_adversarial * adversarial
            optimizer.zero_grad(set_to_none=True)
            if not bool(torch.isfinite(loss)):  # a device's hostile statistics, say: the step is skipped
                skipped += 1
                continue
            loss.backward()
            optimizer.step()
            student.train()
            for _ in range(settings.student_steps):
                kl = distillation_kl(ensemble.detach(), student(x.detach())[0][:, session], settings.temperature)
                student_optimizer.zero_grad(set_to_none=True)
                kl.mean().backward()
                student_optimizer.step()
            steps += 1
            for name, value in (("ce", ce), ("entropy", entropy), ("statistics", statistics_term),
                                ("adversarial", adversarial), ("student_kl", kl.mean())):
                totals[name] += float(value.detach())
        else:
            if steps:  # a generator that has made no finite step yet draws noise, not the session's classes
                finite = torch.isfinite(x.detach()).flatten(1).all(1)  # only finite samples join X~_t
                kept_x.append(x.detach()[finite].cpu().numpy())
                kept_y.append(session[index][finite].cpu().numpy())
            continue
        break  # out of time
    log_ = {f"generator_{name}": value / max(steps, 1) for name, value in totals.items()}
    log_.update(generator_steps=float(steps), generator_skipped_steps=float(skipped),
                generator_s=time.perf_counter() - started,
                generator_bytes=float(generator.parameter_bytes()))
    if not steps:
        log.error("sdd: the generator made no finite step in %d: it is not used (no synthetic samples, FedAvg rows)",
                  skipped)
    if not kept_x:
        return Synthetic(np.zeros((0, *input_shape), np.float32), np.zeros(0, np.int64), log_, student.eval())
    return Synthetic(np.concatenate(kept_x).astype(np.float32), np.concatenate(kept_y).astype(np.int64), log_,
                     student.eval())


def plausible_statistics(statistics: Sequence[dict[str, LayerStatistics] | None], input_range: tuple[float, float],
                         factor: float) -> list[dict[str, LayerStatistics] | None]:
    """Each device's statistics where they could be an honest device's, else None (not used): the input channels'
    means within `input_range` and variances at most ((high - low) / 2)^2, the most values in the range can
    spread; the features' largest |mean| and variance at most `factor` (and `factor`^2) times the lower median
    over the round's devices, so one device's scale cannot set the statistics term (3e38 decodes, being finite,
    and then made every step of the generator non-finite)."""
    low, high = input_range
    spread = ((high - low) / 2) ** 2

    def scale(entry: dict[str, LayerStatistics]) -> tuple[float, float]:
        features = entry["features"]
        return float(np.abs(features.mean).max(initial=0.0)), float(features.var.max(initial=0.0))

    given = [entry for entry in statistics if entry is not None]
    if not given:
        return list(statistics)
    scales = np.array([scale(entry) for entry in given])
    median = np.sort(scales, axis=0)[(len(given) - 1) // 2]
    out: list[dict[str, LayerStatistics] | None] = []
    for entry in statistics:
        if entry is not None:
            inputs = entry["input"]
            mean, var = scale(entry)
            if (inputs.mean.min() < low or inputs.mean.max() > high or inputs.var.max() > spread
                    or mean > factor * max(median[0], 1e-6) or var > factor**2 * max(median[1], 1e-6)):
                entry = None
        out.append(entry)
    return out


def model_for(manifest: Manifest, weights: np.ndarray, device: torch.device) -> ClassifierModel:
    """The classifier with these weights, frozen, on `device`."""
    model = build_for(manifest)
    load_flat_weights(model, manifest, np.asarray(weights, dtype=np.float32))
    return model.to(device).eval().requires_grad_(False)


def _tensors(stats: dict[str, LayerStatistics], device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (torch.from_numpy(s.mean).to(device), torch.from_numpy(s.var).to(device))
            for name, s in stats.items()}


# --- CSWA (Eqs. 12-18) ---------------------------------------------------------------------------------------------

def class_accuracies(models: Sequence[ClassifierModel], x: np.ndarray, y: np.ndarray, classes: Sequence[int],
                     seen: Sequence[int], num_classes: int, device: torch.device) -> np.ndarray:
    """a_m^i: each model's accuracy on the samples of each class of `classes` (argmax over `seen`), (M, c); a
    class with no sample gets 0 for every model."""
    mask = torch.zeros(num_classes, device=device)
    mask[list(seen)] = 1.0
    inputs = torch.from_numpy(x).to(device)
    out = np.zeros((len(models), len(classes)))
    for m, model in enumerate(models):
        with torch.no_grad():
            predicted = model(inputs, mask)[0].argmax(1).cpu().numpy()
        for i, c in enumerate(classes):
            picked = y == c
            out[m, i] = float((predicted[picked] == c).mean()) if picked.any() else 0.0
    return out


def weighted_rows(fedavg: torch.Tensor, local: torch.Tensor, accuracies: np.ndarray, positions: np.ndarray,
                  normalized: bool, row_bound: float = 0.0) -> torch.Tensor:
    """Eqs. 16-18 on a FedAvg result: row i of the new classes' head (its `positions`, one row per class) becomes
    sum_m a_m^i w_m^i, divided by sum_m a_m^i when `normalized`; a row whose accuracies are all 0 keeps its FedAvg
    value. `local` holds the M local models (M x P). `row_bound` > 0: each w_m^i first clipped to that many times
    the lower median length of the rows that count (`row_lengths_bound`)."""
    out = fedavg.clone()
    weights = torch.as_tensor(accuracies, dtype=local.dtype, device=local.device)  # (M, c)
    rows = [torch.as_tensor(row, device=local.device) for row in positions]
    lengths = row_lengths(local, positions)
    limit = row_lengths_bound(lengths, weights, row_bound)
    for i, row in enumerate(rows):
        total = float(weights[:, i].sum())
        if total <= 0:
            continue
        scale = (limit / lengths[:, i].clamp(min=1e-30)).clamp(max=1.0)
        combined = (weights[:, i, None] * scale[:, None] * local[:, row]).sum(0)
        out[row] = combined / total if normalized else combined
    return out


def row_lengths(local: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """||w_m^i||: each local model's (M) length of each new class's row (c): M x c."""
    return torch.stack([torch.linalg.vector_norm(local[:, torch.as_tensor(row, device=local.device)], dim=1)
                        for row in positions], 1)


def row_lengths_bound(lengths: torch.Tensor, weights: torch.Tensor, factor: float) -> float:
    """How long a device's new-class row may be in CSWA: `factor` x the lower median of the lengths of the rows that
    count (those of a device and class with a_m^i > 0, pooled over the session's classes), inf with factor 0.

    Why: CSWA sums rows as they come, so a device that scales its own new-class rows (x2 passes the guard: the rows
    are a sliver of the model) takes the session's classes over every old one (0.693 to 0.406 under the literal sum,
    -6.1 points under the normalised one; issue 56). Pooled, because a class may count one device only; the lower
    median, because with two rows that count the upper one may be the scaled one. Honest rows of a session are
    trained alike from the same start, so they lie near one length."""
    counted = lengths[weights > 0]
    if factor <= 0 or not len(counted):
        return math.inf
    return factor * lower_median(counted)


def lower_median(values: torch.Tensor) -> float:
    """`RunningMedian.lower` of a tensor's values (with two, never the larger); 0 for none."""
    return RunningMedian(values.tolist()).lower() or 0.0


def merge_replay(held: tuple[np.ndarray, np.ndarray] | None, new: Synthetic, per_class: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The replay set with `new`'s samples joined: at most `per_class` per class, a class's newest kept."""
    x = new.x if held is None else np.concatenate([held[0], new.x])
    y = new.y if held is None else np.concatenate([held[1], new.y])
    keep = np.concatenate([np.flatnonzero(y == c)[-per_class:] for c in np.unique(y)]) if len(y) else np.zeros(0, int)
    keep.sort()
    return x[keep], y[keep]


def noisy_mean_statistics(statistics: Sequence[dict[str, LayerStatistics] | None], sizes: Mapping[str, int],
                          clip_norm: float, privacy: RoundPrivacy) -> dict[str, LayerStatistics]:
    """Central DP's statistics (module docstring, "Under central DP"): each device's means and variances, one
    vector, clipped to `clip_norm` (L2), summed with Gaussian noise of sd z x `clip_norm` (a SAMPLED mechanism), over
    the round's selected count (a device that sent none adds zero: whether one did is not looked at, so a fleet
    whose devices send none should set lambda_statistics = 0); variances below 0 read as 0."""
    length = 2 * sum(sizes[layer] for layer in LAYERS)
    total = np.zeros(length)
    for entry in statistics:
        if entry is not None:
            vector = np.concatenate([np.r_[entry[layer].mean, entry[layer].var] for layer in LAYERS]).astype(np.float64)
            norm = float(np.linalg.norm(vector))
            total += vector * min(1.0, clip_norm / norm) if norm > 0 else vector
    mean = privacy.gaussian(total, clip_norm, Release.SAMPLED) / privacy.selected
    out, at = {}, 0
    for layer in LAYERS:
        size = sizes[layer]
        out[layer] = LayerStatistics(layer, mean[at:at + size].astype(np.float32),
                                     np.maximum(mean[at + size:at + 2 * size], 0.0).astype(np.float32),
                                     privacy.selected)
        at += 2 * size
    return out


class SddCoordinator(Strategy):
    """The coordinator half (module docstring): the rule registered as "sdd"."""

    name = "sdd"
    makes_inputs = True  # the generator's samples, within `input_range`

    def __init__(
        self,
        aggregation: str = "cswa-literal",
        new_bias: str = "fedavg",
        row_bound: float = 1.5,
        replay_per_class: int = 50,
        generator_timeout_s: float = 3600.0,
        generator_epochs: int = 20,
        generator_iterations: int = 20,
        generator_batch_size: int = 64,
        nz: int = 32,
        ngf: int = 16,
        generator_lr: float = 1e-3,
        lambda_ce: float = 1.0,
        lambda_entropy: float = 1.0,
        lambda_statistics: float = 1.0,
        lambda_adversarial: float = 1.0,
        adversarial_sign: str = "paper",
        warmup_epochs: int = 5,
        temperature: float = 5.0,
        student_lr: float = 0.2,
        student_steps: int = 1,
        input_range: tuple[float, float] = (0.0, 1.0),
        statistics_factor: float = 100.0,
        statistics_clip_norm: float = 10.0,
        seed: int = 0,
        device: torch.device | str = "auto",
        manifest: Manifest | None = None,
    ) -> None:
        if manifest is None:
            raise ValueError("strategy 'sdd' needs the model's manifest (its generator inverts the model)")
        super().__init__(device, manifest)
        if not (math.isfinite(statistics_factor) and statistics_factor >= 1):
            raise ValueError(f"statistics_factor must be >= 1, got {statistics_factor}")
        self.statistics_factor = statistics_factor
        if not (math.isfinite(statistics_clip_norm) and statistics_clip_norm > 0):
            raise ValueError(f"statistics_clip_norm must be a positive number, got {statistics_clip_norm}")
        self.statistics_clip_norm = statistics_clip_norm
        if not (math.isfinite(row_bound) and (row_bound == 0 or row_bound >= 1)):
            raise ValueError(f"row_bound must be 0 (off) or >= 1, got {row_bound}")
        self.row_bound = row_bound
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if new_bias not in NEW_BIASES:
            raise ValueError(f"new_bias must be one of {NEW_BIASES}, got {new_bias!r}")
        self.new_bias = new_bias
        if replay_per_class < 1 or not (math.isfinite(generator_timeout_s) and generator_timeout_s > 0):
            raise ValueError("replay_per_class must be >= 1 and generator_timeout_s > 0")
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise ValueError(f"input_range must be [low, high] with low < high, got {input_range}")
        self.settings = GeneratorSettings(
            generator_epochs, generator_iterations, generator_batch_size, nz, ngf, generator_lr, lambda_ce,
            lambda_entropy, lambda_statistics, lambda_adversarial, adversarial_sign, warmup_epochs, temperature,
            student_lr, student_steps)
        self.settings.check()
        self.manifest: Manifest = manifest
        self.aggregation, self.replay_per_class, self.timeout_s = aggregation, replay_per_class, generator_timeout_s
        self.built_from = BuiltFrom.MEAN if aggregation == "fedavg" else BuiltFrom.MORE  # CSWA weighs rows by X~
        self.input_range, self.seed = (low, high), seed
        self.sizes = layer_sizes(manifest.input_shape, manifest.feature_dim)
        self.replay: tuple[np.ndarray, np.ndarray] | None = None
        self.session: tuple[int, np.ndarray, np.ndarray] | None = None  # (task, X~_t, its labels)
        self.job: BackgroundJob[AggregateResult] = BackgroundJob("sdd-generator")

    @classmethod
    def central_dp_refused(cls, options: Mapping[str, Any]) -> str | None:
        """Every option runs under central DP (module docstring, "Under central DP")."""
        return None

    def extra_releases(self, ctx: RoundContext) -> tuple[Release, ...]:
        """Where the round trains a generator: its teacher, the noised mean of the round's models (unless that is
        the round's model itself: `aggregation = "fedavg"`), and the noised mean of the devices' statistics (from
        the second session on, where they count)."""
        if not self._generates(ctx):
            return ()
        teacher = (Release.SAMPLED,) if self.aggregation != "fedavg" else ()
        statistics = (Release.SAMPLED,) if ctx.task > 0 and self.settings.lambda_statistics > 0 else ()
        return teacher + statistics

    def inspect(self, update: ClientUpdate) -> None:
        """Only feature statistics, of this model's layers."""
        for name, data in update.attachments.items():
            if name != STATISTICS:
                raise RefusedUpdate("attachments", f"unknown attachment {name!r}")
            try:
                decode_statistics(bytes(data), self.sizes)
            except ValueError as err:
                raise RefusedUpdate("statistics", str(err)) from None

    def aggregate(self, global_weights: torch.Tensor, updates: Sequence[ClientUpdate],
                  ctx: RoundContext = OUTSIDE_A_RUN) -> AggregateResult | Pending:
        """FedAvg, then (module docstring) the generator where the round makes X~ (off the loop), and CSWA where
        the session has it; the replay set goes out at the session's end."""
        validate_updates(global_weights, updates)
        fedavg = WeightedFold(global_weights, True, self.device)
        for update in updates:
            fedavg.add(update)
        averaged = fedavg.result().global_weights
        local = [np.asarray(u.weights, dtype=np.float32).copy() for u in updates]  # a job outlives the payloads
        if not self._generates(ctx):
            metrics: dict[str, float] = {}
            return self._finish(self._weighted(averaged, local, ctx, metrics), ctx, metrics)
        base = ctx.task == 0
        teachers = [averaged.detach().cpu().numpy()] if base else local  # Eq. 4: t = 0, t >= 1
        sent = [] if base else [self._statistics(u) for u in updates]
        statistics = [None] if base else plausible_statistics(sent, self.input_range, self.statistics_factor)
        refused = sum(a is not None and b is None for a, b in zip(sent, statistics))
        if ctx.privacy is not None:  # the generator learns from released numbers alone
            teachers, statistics, averaged = self._private_inputs(averaged, sent, ctx.privacy, ctx)
            refused = 0

        def work(deadline: Deadline) -> AggregateResult:
            synthetic = train_generator(
                [model_for(self.manifest, w, self.device) for w in teachers], statistics, ctx.task_classes,
                self.settings, self.manifest, self.input_range, self.device, self.seed + ctx.task, deadline)
            self.session = (ctx.task, synthetic.x, synthetic.y)
            self.replay = merge_replay(self.replay, synthetic, self.replay_per_class)
            logged = dict(synthetic.log, statistics_refused=float(refused))
            return self._finish(self._weighted(averaged, local, ctx, logged), ctx, logged)

        if not self.job.start(work, self.timeout_s):
            raise RuntimeError("the previous session's generator still runs")
        return Pending(self.job, self.timeout_s + PENDING_MARGIN_S)

    def _private_inputs(self, averaged: torch.Tensor, sent: list[dict[str, LayerStatistics] | None],
                        privacy: RoundPrivacy, ctx: RoundContext
                        ) -> tuple[list[np.ndarray], list[dict[str, LayerStatistics] | None], torch.Tensor]:
        """Under central DP: the generator's one teacher (the released mean of the round's models: the round's model
        itself, released here, where the rule is FedAvg), its statistics (their noised mean, or none), and the
        FedAvg result the round goes on from."""
        mean = averaged.detach().cpu().numpy()
        if self.aggregation == "fedavg":
            averaged = torch.from_numpy(privacy.release(mean)).to(averaged.device)
            teacher = averaged.detach().cpu().numpy()
        else:
            teacher = privacy.mean(mean)
        statistics: list[dict[str, LayerStatistics] | None] = [None]
        if ctx.task > 0 and self.settings.lambda_statistics > 0:
            statistics = [noisy_mean_statistics(sent, self.sizes, self.statistics_clip_norm, privacy)]
        return [teacher], statistics, averaged

    @staticmethod
    def _generates(ctx: RoundContext) -> bool:
        """A session's first round, the base session's last; never without classes to generate (outside a run)."""
        if not ctx.task_classes:
            return False
        return ctx.ends_task if ctx.task == 0 else ctx.starts_task

    def _weighted(self, averaged: torch.Tensor, local: list[np.ndarray], ctx: RoundContext,
                  metrics: dict[str, float]) -> AggregateResult:
        """CSWA (Eqs. 12-18) on the FedAvg result, for a session whose X~ is here; FedAvg otherwise (the base
        session, `aggregation = "fedavg"`, a session whose generator made nothing, in time or at all)."""
        held = self.session
        if ctx.task == 0 or self.aggregation == "fedavg" or held is None or held[0] != ctx.task or not len(held[2]):
            return AggregateResult(averaged)
        models = [model_for(self.manifest, w, self.device) for w in local]
        accuracies = class_accuracies(models, held[1], held[2], ctx.task_classes,
                                      ctx.seen_classes or range(self.manifest.num_classes),
                                      self.manifest.num_classes, self.device)
        positions = class_head_positions(self.manifest.parameters, ctx.task_classes).reshape(
            len(ctx.task_classes), -1)  # each class's row, then its bias
        if self.new_bias == "fedavg":
            positions = positions[:, :-1]
        stacked = torch.from_numpy(np.stack(local)).to(self.device)
        metrics["cswa_mean_accuracy"] = float(accuracies.mean())
        counted = row_lengths(stacked, positions)[torch.as_tensor(accuracies, device=self.device) > 0]
        if len(counted):  # how far the rows that count spread: the longest over the lower median, and those clipped
            median = lower_median(counted)
            metrics["cswa_row_spread"] = float(counted.max()) / max(median, 1e-30)
            metrics["cswa_rows_clipped"] = float((counted > self.row_bound * median).sum()) if self.row_bound else 0.0
        return AggregateResult(weighted_rows(averaged, stacked, accuracies, positions,
                                             normalized=self.aggregation == "cswa-normalized",
                                             row_bound=self.row_bound))

    def _statistics(self, update: ClientUpdate) -> dict[str, LayerStatistics] | None:
        data = update.attachments.get(STATISTICS)
        return None if data is None else decode_statistics(bytes(data), self.sizes)

    def _finish(self, result: AggregateResult, ctx: RoundContext, metrics: dict[str, float]) -> AggregateResult:
        if ctx.ends_task and self.replay is not None:
            result.broadcast = {REPLAY: encode_replay(*self.replay)}
            metrics["replay_samples"] = float(len(self.replay[1]))
            metrics["replay_bytes"] = float(len(result.broadcast[REPLAY]))
        if metrics:
            result.metrics = {"generator": metrics}
        return result

    # --- across a resume ------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        arrays: dict[str, Any] = {}
        if self.replay is not None:
            arrays.update(replay_x=self.replay[0], replay_y=self.replay[1])
        if self.session is not None:
            arrays.update(session_task=np.int64(self.session[0]), session_x=self.session[1],
                          session_y=self.session[2])
        write_atomically(directory / STATE_FILE, npz_bytes(arrays))

    def load(self, directory: Path) -> None:
        path = directory / STATE_FILE
        if not path.exists():
            return
        saved = read_npz(path)
        if "replay_x" in saved:
            self.replay = (saved["replay_x"].astype(np.float32), saved["replay_y"].astype(np.int64))
        if "session_task" in saved:
            self.session = (int(saved["session_task"]), saved["session_x"].astype(np.float32),
                            saved["session_y"].astype(np.int64))

