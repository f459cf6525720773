"""`glfc`: GLFC, federated class-incremental learning (CVPR 2022; spec: shared/specs/glfc.md), the device half.

A round on a device:
1. The head is one sigmoid per class of the fleet's tasks so far (Eq. 1: C^p + C^t outputs): the model's fixed
   maximum head under a mask of the classes the round names as the fleet's (`known_classes`, which a fleet sends
   for this policy: `head_classes = "fleet"`) and those the device has seen. The BCE pushes down every visible
   logit but the label's, so a device lowers the classes other devices hold as the authors' clients do; a class
   no task has named yet stays masked (neither pulled nor pushed). A new class's row starts as the global model
   has it (never trained while masked), where the authors' code grows the head with freshly initialised rows: the
   same start, without a server that knows the classes in advance.
2. Local training runs its own loop (`fit`), one extra eval forward pass per batch: the class-aware gradient
   compensation (Eqs. 2-4) weighs each sample by |G_i| / the mean |G| of its group (old classes: those the device
   saw before this task; new: the rest), G_i = sigmoid(z_{i,y_i}) - 1 of the model being trained, detached. The
   weights change with every step, so they are computed per batch from that batch's logits: any backend, no new
   graph (`benchmarks/glfc.py` measures the extra pass). With `compensation = false` (the "w/o CGC" ablation)
   every weight is 1.
3. Class-semantic relation distillation (Eq. 5) from the stored old model, with Y-hat the one-hot labels whose
   old classes' columns (the first C^p: every class of an earlier task the head covers, the fleet's included,
   `RoundView.old_classes`) hold the old model's sigmoid outputs. `relation = "kl"` (the default: the paper's
   form) is D_KL between Y-hat and the softmax of the current logits over the visible classes, read as KL(Y-hat ||
   softmax(z)) with Y-hat unnormalised as printed (the printed argument order is undefined where Y-hat is 0); up
   to a constant that is the loss's soft-target term (models/loss.py), so the step is exact on every backend.
   `relation = "bce"` is the authors' code: a BCE against Y-hat, which is iCaRL's distillation (what the paper's
   "w/o CRD" ablation puts in its place); BCE is linear in its target, so lambda_1 w_i BCE(z, y) + lambda_2 BCE(z,
   Y-hat) is one BCE with weight lambda_1 w_i + lambda_2 and their weighted mean as target. `relation = "none"`
   drops the term. Form and scale are separate options: `relation_scale = "mean"` (the default) puts the term at
   the authors' scale, averaged over the visible classes as their BCE and the task term are; "sum" is Eq. 5 as
   printed, a sum over the classes (the KL's gradient softmax(z) sum(Y-hat) - Y-hat is then about C times the
   authors' at C visible classes: 6.5x at 4, 11.7x at 10). lambda = (1, 0) in the first task, (`lambda_gc`,
   `lambda_rd`) = (0.5, 0.5) afterwards.
4. Memory: iCaRL's exemplars, by herding on L2-normalised features without replacement (`herding_order`), the
   quota water-filled over the classes seen before the task (M - N_new slots, as every policy), each class kept in
   the order herding chose when the class became old, so a smaller quota later is a truncation (the order is
   kept per class as sample fingerprints in `glfc/memory.npz`, a file of M like the others).
5. At a new task the old model is stored (a `BudgetedFile` of M, `old_model_share`): the proxy's best model of the
   previous task when one was broadcast (`glfc/old-model`), else the latest global model received before the
   switch (the "w/o PRS" ablation's old model: the paper does not say which it used). After the first round's
   training of a task, for each of the task's new classes the sample nearest the class-mean feature (the
   prototype) goes through the fixed encoding network Gamma, and the gradient of its cross-entropy w.r.t. Gamma's
   parameters is attached to the update (`glfc/prototype/<k>`), for the proxy. Before that the prototype is
   perturbed as the paper defines it (Eqs. 10-11): `refine_steps` SGD steps of `refine_lr` (0.1, the paper's) on
   the sample, each down the cross-entropy of its label through the locally trained model at the sample's features
   plus Gaussian noise, gamma N(0, sigma^2) (`refine_noise` = gamma = 0.1, sigma^2 the class's feature variance
   over the device's samples of it, per feature, drawn anew each step from the learner's rng). The paper gives no
   step count: 50, the authors' code's, which also decays the sample's weights by 1e-5 (kept) but descends the
   BCE, at 0.2, without the noise (`refine_loss = "bce"`, `refine_lr = 0.2`, `refine_noise = 0`: the code's
   variant; `refine_steps = 0`: no perturbation, the sample itself goes up). The noise reaches the gradient
   without a graph of its own: the head is linear, so noise n on the features moves the logits by W n, and a
   loss whose gradient at the logits z is the head's loss's at z + W n (`shifted_logits_loss`) runs through
   every backend's input gradient (`Trainer.input_gradient`; the ort backend needs the portable graphs beside
   its own for it, and the device refuses the policy in one line without them). It costs two forward passes and
   one backward pass per step and new class, once per task. What it buys against the proxy's inversion is
   measured in docs/methods/glfc.md (issue 59).
6. Task detection (Eq. 7), for streams that do not announce tasks (`task_boundary`): the mean softmax entropy of a
   chunk under the latest global model against that of the data before it: the task's training data at the start
   of the device's last round (the paper's H^{r-1,t}, computed in `training_set`: a round costs one more forward
   pass over the task's samples), or the previous chunk's; each over the head GLFC's received model would
   have: the classes seen and the data's own labels (in GLFC the server grows the head at a new task, and the
   jump comes mostly from the new, untrained logits; a head masked to the classes seen stays confidently wrong on
   new classes, 0.02-0.3 nats on digits). The paper's absolute r_h = 1.2 cannot fire where ln C < 1.2 (tasks of
   2-5 classes); here r_h = `entropy_ratio` * ln C, C the classes of that head. Measured on digits (LeNet trained
   on 2-5 classes, chunks of 40): the jump at a new pair of classes was 0.16-0.78 nats (0.19 under a model
   still learning 5 classes), more samples of the old classes moved it by about 0; `entropy_ratio` = 0.05 puts
   r_h at 0.07-0.1 nats, below every jump measured. It stays a weak signal on small tasks: where the stream
   names its tasks or a chunk brings unseen labels (`detect_new_tasks`), those say it for certain.

Gamma is a registered model (`gamma`; "auto", the default: the authors' sigmoid LeNet on images, the small
`glfc_mlp` on any other input, models/glfc.py `gamma_model`) built from `gamma_seed`, the fleet's shared secret: the
host exports it beside the model's artifacts (`export_artifacts`, for the backends the model serves) and the proxy
builds the same network from the same seed. Its weights are a
`BudgetedFile` of M too (copied from the artifacts at open).
"""
from __future__ import annotations

import hashlib
import logging
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from edge_client.budget import BudgetedFile
from edge_client.policies.base import (
    AttachedValues,
    PolicyContext,
    ReplayPolicy,
    RoundView,
    Samples,
    TrainingSet,
    balanced_quotas,
    interleave_by_class,
)
from edge_client.policies.herding import herding_order
from edge_client.trainers.base import LossInputs, Proximal, Trainer, iterate_batches, softmax
from edgefil.durable import npz_bytes, read_npz
from models.glfc import GAMMA_AUTO, decode_old_model, encode_gradient, gamma_model, prototype_name
from models.manifest import FULL_GRADIENT, HEAD_WEIGHT, WEIGHTS, named_parameter

if TYPE_CHECKING:
    from edge_client.trainers.choice import Backend

log = logging.getLogger(__name__)
RELATIONS = ("kl", "bce", "none")
RELATION_SCALES = ("mean", "sum")
ENTROPY_RATIO = 0.05  # r_h = ENTROPY_RATIO * ln C (module docstring, 6)
OLD_MODEL_HOLDER, GAMMA_HOLDER, MEMORY_HOLDER = "glfc-old-model", "glfc-gamma", "glfc-memory"
FOLDER = "glfc"


def compensation_weights(p_true: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Eqs. 2-4: |G_i| / mean |G| over i's group (old or new classes), G_i = p_i[y_i] - 1; each group's weights
    average 1 (a group whose |G| are all 0, every sample learnt, keeps weights of 1)."""
    g = np.abs(np.asarray(p_true, dtype=np.float64) - 1.0)
    weights = np.ones_like(g)
    for group in (old, ~old):
        mean = g[group].mean() if group.any() else 0.0
        if mean > 0:
            weights[group] = g[group] / mean
    return weights.astype(np.float32)


@dataclass
class WeightSpread:
    """How unevenly the compensation weights spread a round's gradient, batch by batch (metrics of the round):
    `compensation_ess`, the mean effective sample share (sum w)^2 / (n sum w^2) (1: every sample counts alike);
    `compensation_on_unlearnt`, the mean share of the weight that the unlearnt samples carry (the sigmoid of their
    label's logit below 0.5), beside `unlearnt`, their mean share of the samples. Where the first is low and the
    second far above the third, a few unlearnt samples drive the step."""

    batches: int = 0
    ess: float = 0.0
    on_unlearnt: float = 0.0
    unlearnt: float = 0.0

    def add(self, weights: np.ndarray, p_true: np.ndarray) -> None:
        w = weights.astype(np.float64)
        below = p_true < 0.5
        self.batches += 1
        self.ess += float(w.sum() ** 2 / (len(w) * (w * w).sum())) if (w * w).sum() > 0 else 1.0
        self.on_unlearnt += float(w[below].sum() / w.sum()) if w.sum() > 0 else 0.0
        self.unlearnt += float(below.mean())

    def metrics(self) -> dict[str, float]:
        if not self.batches:
            return {}
        n = self.batches
        return {"compensation_ess": self.ess / n, "compensation_on_unlearnt": self.on_unlearnt / n,
                "unlearnt": self.unlearnt / n}


def relation_targets(y: np.ndarray, num_classes: int, old_probs: np.ndarray, old_classes: np.ndarray) -> np.ndarray:
    """Eq. 5's Y-hat: one-hot labels with the old classes' columns replaced by the old model's sigmoid outputs."""
    targets = np.zeros((len(y), num_classes), dtype=np.float32)
    targets[np.arange(len(y)), y] = 1.0
    targets[:, old_classes] = old_probs[:, old_classes]
    return targets


def glfc_loss(y: np.ndarray, num_classes: int, weights: np.ndarray, lambda_gc: float, lambda_rd: float,
              relation: np.ndarray | None, form: str = "kl", scale: str = "mean",
              visible: int | None = None) -> LossInputs:
    """Eq. 6's loss inputs for one batch: lambda_gc w_i BCE(z_i, onehot y_i) plus lambda_rd times the relation
    term against Y-hat (`relation`, None: none), its KL form as the soft-target term or its BCE form merged into
    one BCE (module docstring, 3). The task term's BCE averages over the `visible` classes (None: all of them);
    `scale` "mean" puts the relation term at that scale too (the authors' code: a BCE averaged over the classes),
    "sum" sums it over them (Eq. 5's KL as printed). Form and scale are separate: the KL form is a sum, so "mean"
    divides it by the visible classes; the BCE form is a mean, so "sum" multiplies it by them."""
    onehot = np.zeros((len(y), num_classes), dtype=np.float32)
    onehot[np.arange(len(y)), y] = 1.0
    summed, classes = form == "kl", num_classes if visible is None else max(visible, 1)
    factor = 1.0 if (scale == "sum") == summed else (1.0 / classes if summed else float(classes))
    if form == "kl" and relation is not None:
        return LossInputs(sample_weights=np.float32(lambda_gc) * weights.astype(np.float32), targets=onehot,
                          head="sigmoid-bce", soft_targets=relation.astype(np.float32),
                          soft_weights=np.full(len(y), lambda_rd * factor, dtype=np.float32))
    a = np.float32(lambda_gc) * weights.astype(np.float32)
    b = np.float32(lambda_rd * factor if relation is not None else 0.0)
    total = a + b
    mixed = a[:, None] * onehot + (b * relation if relation is not None else 0.0)
    targets = np.where(total[:, None] > 0, mixed / np.maximum(total, 1e-12)[:, None], onehot).astype(np.float32)
    return LossInputs(sample_weights=total.astype(np.float32), targets=targets, head="sigmoid-bce")


def mean_entropy(masked_logits: np.ndarray) -> float:
    """Eq. 7's mean softmax entropy -sum p log(p + 1e-5) (the authors' guard), over the unmasked classes."""
    if not len(masked_logits):
        return 0.0
    p = softmax(masked_logits)
    return float(-(p * np.log(p + 1e-5)).sum(axis=1).mean())


def fingerprint(x: np.ndarray) -> np.ndarray:
    """8 bytes per sample that name it across restarts: how the memory order finds its samples again."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
    return np.array([int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True)
                     for r in rows], dtype=np.int64)



REFINE_HEADS = {"ce": "softmax-ce", "bce": "sigmoid-bce"}  # the perturbation's `refine_loss` -> the loss's head
REFINE_LOSSES = tuple(REFINE_HEADS)


def shifted_logits_loss(logits: np.ndarray, mask: np.ndarray, shift: np.ndarray, head: str) -> LossInputs:
    """The loss whose gradient at one sample's `logits` is `head`'s loss's gradient at logits + `shift` (noise on
    the features through the linear head): the head's own term, plus a teacher term whose gradient is exactly the
    difference v. The teacher term, a squared distance to teacher logits T over the visible classes over their
    count V, has gradient 2 (z - T) / V: T = z - v V / 2 gives v. The softmax CE's gradient is p - y, so v =
    softmax(z + shift) - softmax(z); the BCE's is (sigmoid(z) - y) / V, so v = (sigmoid(z + shift) - sigmoid(z)) / V.
    Hidden classes (mask 0) take no part."""
    visible = mask > 0
    count = max(float(mask.sum()), 1.0)
    z = logits.astype(np.float64)[visible]
    moved = z + np.asarray(shift, dtype=np.float64)[visible]
    if head == "softmax-ce":
        v = softmax(moved[None])[0] - softmax(z[None])[0]
    else:
        v = (sigmoid(moved) - sigmoid(z)) / count
    teacher = np.zeros(mask.shape, dtype=np.float64)
    teacher[visible] = z - v * count / 2
    return LossInputs(head=head, teacher_logits=teacher[None].astype(np.float32),
                      teacher_weights=np.ones(1, dtype=np.float32))


def sigmoid(z: np.ndarray) -> np.ndarray:
    """The logistic function in float64, without overflow at masked logits (about -1e9: exactly 0)."""
    return 0.5 * (1.0 + np.tanh(0.5 * z.astype(np.float64)))


@dataclass
class Glfc(ReplayPolicy):
    name = "glfc"
    head_classes = "fleet"  # one sigmoid per class of the fleet's tasks so far (Eq. 1; module docstring, 1)

    compensation: bool = True  # class-aware gradient compensation; False: the "w/o CGC" ablation
    # the compensation in the first task too (the paper's), where no class is old: there it corrects no imbalance
    # between old and new and only moves the step onto the least-learnt samples (docs/results.md measures both)
    compensate_first_task: bool = True
    relation: str = "kl"  # relation distillation: "kl" (the paper's Eq. 5), "bce" (the authors' code), "none"
    # the relation term's scale, apart from its form: "mean" over the visible classes (the authors' code, whose BCE
    # averages over the classes as the task term does), or "sum" over them (Eq. 5's KL as printed: about C times
    # as heavy at C visible classes, the default before issue 55)
    relation_scale: str = "mean"
    lambda_gc: float = 0.5  # lambda_1 from the second task on (the first task trains with (1, 0))
    lambda_rd: float = 0.5  # lambda_2
    entropy_ratio: float = ENTROPY_RATIO  # task detection: r_h = entropy_ratio * ln(visible classes)
    prototypes: bool = True  # upload prototype gradients at a new task (the proxy's input)
    # the prototype's perturbation (Eqs. 10-11; module docstring, 5): SGD steps on the sample (0: none), their
    # rate, the features' noise (gamma x N(0, the class's feature variance)) and the loss ("ce", the paper's; "bce",
    # the authors' code's)
    refine_steps: int = 50
    refine_lr: float = 0.1
    refine_noise: float = 0.1
    refine_loss: str = "ce"
    gamma: str = GAMMA_AUTO  # the encoding network: a registered model, or chosen by the inputs (`gamma_model`)
    gamma_seed: int = 2021  # its weights: the fleet's shared secret, the proxy's too
    old_model_share: float = 0.5  # the most of M's bytes the old model may take
    _trainer: Trainer | None = field(default=None, init=False, repr=False)
    _gamma: Trainer | None = field(default=None, init=False, repr=False)
    _files: dict[str, BudgetedFile] = field(default_factory=dict, init=False, repr=False)
    _latest: np.ndarray | None = field(default=None, init=False, repr=False)  # the latest global model
    _broadcast: tuple[np.ndarray, int] | None = field(default=None, init=False, repr=False)  # proxy's old model
    _task: int = field(default=-1, init=False, repr=False)  # the task the old model was stored for
    _uploaded_for: int = field(default=-1, init=False, repr=False)  # the task whose prototypes went up
    _pending: dict[str, bytes] = field(default_factory=dict, init=False, repr=False)
    _entropy: float | None = field(default=None, init=False, repr=False)
    _round: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise ValueError(f"relation must be one of {', '.join(RELATIONS)}, got {self.relation!r}")
        if self.relation_scale not in RELATION_SCALES:
            raise ValueError(f"relation_scale must be one of {', '.join(RELATION_SCALES)}, got "
                             f"{self.relation_scale!r}")
        for name in ("lambda_gc", "lambda_rd", "entropy_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.refine_steps < 0 or not (math.isfinite(self.refine_lr) and self.refine_lr > 0) \
                or not (math.isfinite(self.refine_noise) and self.refine_noise >= 0):
            raise ValueError("refine_steps must be >= 0, refine_lr a positive number and refine_noise >= 0")
        if self.refine_loss not in REFINE_LOSSES:
            raise ValueError(f"refine_loss must be one of {', '.join(REFINE_LOSSES)}, got {self.refine_loss!r}")
        if not 0.0 < self.old_model_share <= 1.0:
            raise ValueError(f"old_model_share must lie in (0, 1], got {self.old_model_share}")
        from models.zoo import REGISTRY

        if self.gamma != GAMMA_AUTO and self.gamma not in REGISTRY:
            raise ValueError(f"gamma must be \"{GAMMA_AUTO}\" or a registered model ({', '.join(sorted(REGISTRY))}), "
                             f"got {self.gamma!r}")

    # --- host and open --------------------------------------------------------------------------

    @classmethod
    def gamma_folder(cls, options: Mapping[str, Any], model_artifacts: Path) -> Path:
        """Where Gamma's artifacts lie beside the model's: named by the network Gamma is (`gamma_model`), its seed
        and what it takes and tells apart (the model's inputs and classes), so that two models' artifacts in one
        folder keep a Gamma each (one named by network and seed alone was the first model's for both)."""
        from models.manifest import load_manifest

        manifest = load_manifest(model_artifacts)
        gamma = cls.gamma_name(options, manifest.input_shape)
        inputs = "x".join(str(size) for size in manifest.input_shape)
        return Path(model_artifacts).parent / (f"glfc-gamma-{gamma}-{options.get('gamma_seed', cls.gamma_seed)}-"
                                               f"{inputs}-{manifest.num_classes}")

    @classmethod
    def gamma_name(cls, options: Mapping[str, Any], input_shape: Sequence[int]) -> str:
        """The registered model `options`' Gamma is, for a model of `input_shape`."""
        return gamma_model(str(options.get("gamma", cls.gamma)), input_shape)

    @classmethod
    def export_artifacts(cls, options: Mapping[str, Any], model_artifacts: Path, seed: int = 0) -> None:
        """Gamma's artifacts beside the model's (for the backends the model serves), when missing, through the
        host's export cache; none of the optional graphs: a device runs only Gamma's gradient of the plain
        cross-entropy. Host only."""
        folder = cls.gamma_folder(options, model_artifacts)
        if (folder / "manifest.json").is_file():
            return
        from models.export import export_registered
        from models.manifest import load_manifest

        manifest = load_manifest(model_artifacts)
        export_registered(cls.gamma_name(options, manifest.input_shape), manifest.num_classes, folder,
                          input_shape=tuple(manifest.input_shape), seed=int(options.get("gamma_seed", cls.gamma_seed)),
                          backends=manifest.backends, cache=True, graphs=())

    def trainer_graphs(self) -> frozenset[str]:
        """Eq. 6's loss is a sigmoid head's (`glfc_loss`): the whole loss's gradient; the prototype's refinement
        descends the input gradient."""
        return frozenset({FULL_GRADIENT, "input_gradient"} if self.refine_steps else {FULL_GRADIENT})

    def open(self, ctx: PolicyContext) -> None:
        """The files GLFC keeps under M: the old model (when a relation term uses it), Gamma's weights (when
        prototypes go up) and the memory order. What an option turns off costs no byte."""
        self._trainer = ctx.trainer
        state = Path(ctx.state_dir) / FOLDER
        self._files = {MEMORY_HOLDER: BudgetedFile(ctx.budget, MEMORY_HOLDER, state / "memory" / "order.npz")}
        if self.relation != "none":
            self._files[OLD_MODEL_HOLDER] = BudgetedFile(ctx.budget, OLD_MODEL_HOLDER, state / "old-model" /
                                                         "weights.f32", share=self.old_model_share)
            stored_old = self._stored_old_model()
            self._task = stored_old[0] if stored_old is not None else -1  # a restart mid-task keeps its old model
            if not self._files[OLD_MODEL_HOLDER].can_ever_hold(4 + 4 * ctx.trainer.manifest.num_parameters):
                log.warning("policy glfc: the old model can never fit old_model_share of M: no relation "
                            "distillation")
        if self.prototypes:
            self._gamma = self._open_gamma(ctx, state)

    def _open_gamma(self, ctx: PolicyContext, state: Path) -> Trainer:
        """Gamma's trainer, its weights a file of M (copied from the artifacts at the first open)."""
        from edge_client.trainers.choice import TrainerSettings, make_trainer

        folder = self.gamma_folder({"gamma": self.gamma, "gamma_seed": self.gamma_seed}, ctx.artifacts)
        if not (folder / "manifest.json").is_file():
            raise FileNotFoundError(f"no GLFC encoding network at {folder}: the host exports it "
                                    f"(Glfc.export_artifacts, done by a fleet run before its devices start)")
        held = self._files[GAMMA_HOLDER] = BudgetedFile(ctx.budget, GAMMA_HOLDER, state / "gamma" / "weights.f32")
        gamma = make_trainer(TrainerSettings(backend=cast("Backend", ctx.trainer.backend)), folder)
        if held.read() is None and not held.write((folder / WEIGHTS).read_bytes()):
            raise ValueError(f"policy glfc: its encoding network {folder.name} ({(folder / WEIGHTS).stat().st_size} "
                             f"bytes) does not fit what [store] max_bytes leaves; choose a smaller gamma, set "
                             f"prototypes = false, or raise max_bytes")
        gamma.set_weights(np.frombuffer(held.read() or b"", dtype="<f4").astype(np.float32))
        return gamma

    # --- the round ------------------------------------------------------------------------------

    def on_global_model(self, view: RoundView, weights: np.ndarray) -> None:
        self._latest = weights

    def receive(self, view: RoundView, payloads: Mapping[str, bytes]) -> None:
        old = decode_old_model(payloads, view.trainer.manifest.num_parameters)
        if old is not None:
            self._broadcast = old

    def task_boundary(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> bool:
        """Eq. 7 with the scaled threshold (module docstring, 6): this chunk's mean entropy under the latest model,
        over the classes seen and the chunk's labels, against the entropy of the data before it: the last round's
        training data at the round's start (`training_set`), or the previous chunk's; where neither was seen (a
        restarted device) that of the task's stored samples now, and with none H = 0, as the authors' code starts."""
        entropy, classes = self._entropy_of(view, x, y)
        previous, self._entropy = self._entropy, entropy
        if previous is None and view.n_stored():
            held = view.stored(view.task)
            previous = self._entropy_of(view, held.x, held.y)[0] if len(held) else None
        self._round["entropy"] = entropy
        return entropy - (previous or 0.0) >= self.entropy_ratio * math.log(max(classes, 2))

    def _entropy_of(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """The mean entropy of `x` under the trainer's weights over the classes seen and `y`'s, and their count."""
        head = np.zeros(view.trainer.manifest.num_classes, dtype=np.float32)
        head[np.flatnonzero(view.label_counts)] = 1.0
        head[np.unique(y)] = 1.0
        logits, _ = view.trainer.outputs(x, y, head)
        return mean_entropy(logits), int(head.sum())

    def rank(self, old: Samples, keep: int, view: RoundView) -> np.ndarray:
        """iCaRL's memory: per class, the order herding chose when the class became old (kept in a file of M), so
        a smaller quota is a truncation; classes new to the memory are herded now with the current model."""
        names = fingerprint(old.x)
        orders = self._memory_orders()
        quotas = balanced_quotas(old.y, keep)
        chosen: dict[int, np.ndarray] = {}
        features: np.ndarray | None = None
        for c, quota in quotas.items():
            members = np.flatnonzero(old.y == c)
            if c in orders:
                position = {int(n): i for i, n in enumerate(orders[c])}
                known = sorted((position[int(names[m])], m) for m in members if int(names[m]) in position)
                order = [m for _, m in known] + [m for m in members if int(names[m]) not in position]
                ranked = np.asarray(order, dtype=np.int64)
            else:
                if features is None:
                    _, raw = view.trainer.outputs(old.x, old.y, view.class_mask)
                    features = raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
                ranked = members[herding_order(features[members], len(members))]
            chosen[c] = ranked[:quota]
            orders[c] = names[ranked[:quota]]
        self._save_memory_orders({c: orders[c] for c in chosen})
        return interleave_by_class(chosen)

    def training_set(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> TrainingSet:
        """At a new task the old model is stored; every round, the entropy of the task's data at the round's start
        (Eq. 7's H^{r,t}: every client, every round, the paper's; here the rounds a device trains) is what the next
        chunk is compared with (`task_boundary`)."""
        if view.task != self._task:
            self._store_old_model(view)
            self._task = view.task
        current = view.stored_tasks() == view.task
        if current.any():
            self._entropy, _ = self._entropy_of(view, x[current], y[current])
        return TrainingSet(x, y)

    def fit(self, view: RoundView, batch: TrainingSet, epochs: int, proximal: Proximal | None) -> float:
        """E epochs of GLFC steps: per batch, the compensation weights from one eval forward pass of the model
        being trained, and the relation targets from the old model's outputs (computed once per round)."""
        trainer = view.trainer
        x, y, mask, proximal, _ = trainer.fit_inputs(batch.x, batch.y, view.class_mask, proximal)
        k = trainer.manifest.num_classes
        own_old = view.seen_before_task()  # the compensation's old group: the device's own (the authors' code)
        old_classes = view.old_classes()  # Y-hat's old columns: every class of earlier tasks the head covers
        is_old = np.isin(y, own_old)
        first = len(old_classes) == 0
        visible = int(mask.sum())
        lambda_gc, lambda_rd = (1.0, 0.0) if first else (self.lambda_gc, self.lambda_rd)
        old_weights = None if first or self.relation == "none" else self._old_model()
        old_probs = None
        if old_weights is not None:
            old_probs = sigmoid(trainer.teacher_logits(old_weights, x).astype(np.float64))
        forwards = last = 0.0
        spread = WeightSpread()
        for _ in range(epochs):
            total = 0.0
            for idx in iterate_batches(len(y), view.batch_size, view.rng):
                weights = np.ones(len(idx), dtype=np.float32)
                if self.compensation and (self.compensate_first_task or not first):
                    _, logits, _ = trainer.forward(x[idx], y[idx], mask)
                    forwards += 1
                    p_true = sigmoid(logits[np.arange(len(idx)), y[idx]].astype(np.float64))
                    weights = compensation_weights(p_true, is_old[idx])
                    spread.add(weights, p_true)
                relation = None if old_probs is None else relation_targets(y[idx], k, old_probs[idx], old_classes)
                loss = glfc_loss(y[idx], k, weights, lambda_gc, lambda_rd, relation, self.relation,
                                 self.relation_scale, visible)
                total += len(idx) * trainer.fit(x[idx], y[idx], epochs=1, batch_size=len(idx), class_mask=mask,
                                                proximal=proximal, loss=loss)
            last = total / max(len(y), 1)
        self._round.update(extra_forward_passes=forwards, relation_distillation=float(old_probs is not None),
                           **spread.metrics())
        return last

    def after_training(self, view: RoundView, x: np.ndarray, y: np.ndarray) -> None:
        """After the first round of a task: the prototype gradients of its new classes (module docstring, 5)."""
        self._pending = {}
        if not self.prototypes or view.task == self._uploaded_for or not len(y):
            return
        self._uploaded_for = view.task
        new = [c for c in np.unique(y).tolist() if c not in set(view.seen_before_task().tolist())]
        if not new:
            return
        _, features = view.trainer.outputs(x, y, view.class_mask)
        gamma = self._require_gamma()
        for k, c in enumerate(new):
            members = np.flatnonzero(y == c)
            centre = features[members].mean(axis=0)
            nearest = members[int(np.linalg.norm(features[members] - centre, axis=1).argmin())]
            prototype = self._refined(view, x[nearest : nearest + 1], c, features[members].std(axis=0))
            _, gradient = gamma.gradient(prototype, np.array([c], dtype=np.int64))
            self._pending[prototype_name(k)] = encode_gradient(gradient)
        self._round["prototypes"] = float(len(self._pending))

    def _refined(self, view: RoundView, prototype: np.ndarray, label: int, spread: np.ndarray) -> np.ndarray:
        """Eqs. 10-11 (module docstring, 5): SGD on the sample down its label's loss at its features plus noise of
        sd `refine_noise` x `spread` (the class's features' sd), weight decay 1e-5."""
        trainer = view.trainer
        target = np.array([label], dtype=np.int64)
        mask = trainer.mask(view.class_mask)
        head = REFINE_HEADS[self.refine_loss]
        weights = named_parameter(trainer.get_weights(), trainer.manifest.parameters, HEAD_WEIGHT).astype(np.float64)
        for _ in range(self.refine_steps):
            if self.refine_noise:
                logits, _ = trainer.outputs(prototype, target, view.class_mask)
                shift = weights @ (self.refine_noise * view.rng.normal(0.0, 1.0, spread.shape) * spread)
                loss = shifted_logits_loss(logits[0], mask, shift, head)
            else:
                loss = LossInputs(head=head)
            _, gradient = trainer.input_gradient(prototype, target, view.class_mask, loss)
            prototype = (prototype - np.float32(self.refine_lr) * (gradient + np.float32(1e-5) * prototype))
        return prototype.astype(np.float32)

    def attachments(self, view: RoundView) -> dict[str, bytes]:
        return dict(self._pending)

    def attaches(self) -> bool:
        return self.prototypes

    def attached_values(self) -> AttachedValues | None:
        """The prototype gradients, one after another (each Gamma's parameters, float32)."""
        if not self._pending:
            return None
        names = sorted(self._pending)
        gradients = [np.frombuffer(self._pending[name], dtype="<f4") for name in names]
        ends = np.cumsum([len(g) for g in gradients])

        def encode(values: np.ndarray) -> dict[str, bytes]:
            return {name: encode_gradient(part) for name, part in zip(names, np.split(values, ends[:-1]))}

        return AttachedValues(np.concatenate(gradients).astype(np.float64), encode)

    def releases_values(self) -> bool:
        return True

    def release_bytes(self, view: RoundView) -> bool:
        """The old model goes first when a new task's real samples do not fit beside it (real data first)."""
        return self._files[OLD_MODEL_HOLDER].remove() if OLD_MODEL_HOLDER in self._files else False

    def metrics(self) -> dict[str, float]:
        numbers, self._round = self._round, {}
        return numbers

    # --- what it keeps --------------------------------------------------------------------------

    def _store_old_model(self, view: RoundView) -> None:
        """At a new task: the proxy's best model of the previous task if it sent one, else the latest global model
        received before the switch (none without a relation term: nothing would read it)."""
        if OLD_MODEL_HOLDER not in self._files:
            return
        candidate = None
        if self._broadcast is not None and self._broadcast[1] == view.task - 1:
            candidate, source = self._broadcast[0], "proxy"
        elif self._latest is not None:
            candidate, source = self._latest, "latest-global"
        if candidate is None or view.task == 0:
            return
        header = np.array([view.task], dtype="<i4").tobytes()  # the task it serves: a restart does not store again
        stored = self._files[OLD_MODEL_HOLDER].write(header + np.ascontiguousarray(candidate, dtype="<f4").tobytes())
        self._round.update(old_model_stored=float(stored), old_model_from_proxy=float(source == "proxy"))

    def _stored_old_model(self) -> tuple[int, np.ndarray] | None:
        """(the task it serves, its weights) as stored; None when there is none or it is not this model's."""
        data = self._files[OLD_MODEL_HOLDER].read() if OLD_MODEL_HOLDER in self._files else None
        trainer = self._trainer
        if data is None or trainer is None or len(data) != 4 + 4 * trainer.manifest.num_parameters:
            return None
        weights = np.frombuffer(data, dtype="<f4", offset=4).astype(np.float32)
        return int(np.frombuffer(data[:4], dtype="<i4")[0]), weights

    def _old_model(self) -> np.ndarray | None:
        stored = self._stored_old_model()
        return None if stored is None else stored[1]

    def _memory_orders(self) -> dict[int, np.ndarray]:
        data = self._files[MEMORY_HOLDER].read() if MEMORY_HOLDER in self._files else None
        if data is None:
            return {}
        try:
            return {int(name.split("-")[1]): order.astype(np.int64) for name, order in read_npz(data).items()}
        except (OSError, ValueError, KeyError, IndexError, EOFError, zipfile.BadZipFile):
            log.warning("glfc: the memory order does not load; herding the old classes again")
            return {}

    def _save_memory_orders(self, orders: dict[int, np.ndarray]) -> None:
        if MEMORY_HOLDER not in self._files:
            return
        arrays: dict[str, Any] = {f"class-{c}": np.asarray(v, dtype=np.int64) for c, v in orders.items()}
        if not self._files[MEMORY_HOLDER].write(npz_bytes(arrays)):
            log.warning("glfc: no room for the memory order; the next switch herds the old classes again")

    def _require_gamma(self) -> Trainer:
        if self._gamma is None:
            raise RuntimeError("the glfc policy is not open: the learner calls open() with its state folder")
        return self._gamma
