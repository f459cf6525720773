"""The one training loss every method shapes through its inputs, written once in torch.

Both trainer backends run this function: the torch backend calls it, and the export traces it into the ORT
training graph (`models/export.py`), whose extra inputs are exactly its arguments. A method never needs a new
export path: it chooses the inputs.

Per sample i of a batch of B, with raw logits r_i, the mask m over classes (1 = visible), masked logits
z_i = r_i + (m - 1) * MASK_FILL, targets t_i (one-hot labels, or soft / multi-hot), sample weight w_i, teacher
logits s_i and teacher weight d_i, soft targets q_i and soft weight u_i, class costs c_i:

    head "softmax-ce" (bce = 0):  task_i = -sum_k t_ik log softmax(z_i)_k
    head "sigmoid-bce" (bce = 1): task_i = sum_k m_k [softplus(r_ik) - t_ik r_ik] / sum_k m_k
    teacher term:                 dist_i = sum_k m_k (r_ik - s_ik)^2 / sum_k m_k
    soft-target term:             soft_i = -sum_k m_k q_ik log softmax(z_i)_k
    expected-cost term:           cost_i = sum_k m_k c_ik softmax(z_i)_k
    loss = (1 / B) sum_i [w_i (task_i + d_i dist_i) + u_i soft_i + cost_i]

The soft-target term is a softmax cross-entropy against any distribution, beside whichever head the task term
uses: KL(q_i || softmax(z_i)) up to a constant, the distillation a method adds to a BCE head (GLFC's Eq. 5 as its
paper writes it) or to a CE one (knowledge distillation at temperature 1). Its weight u_i stands beside the sample
weight rather than under it, so a method that weighs the task term per sample (GLFC's gradient compensation) keeps
its distillation whole.

The expected-cost term is linear in the probabilities, where every other term is linear in their logarithm: the
reverse cross-entropy of symmetric cross-entropy (SCE), -sum_k p_k log t_k with log 0 clamped to A, is this term
with c_ik = -A for every class k but the label and 0 for the label (a noise-robust loss for labels that may be
wrong: a wrong label costs at most -A, where the forward cross-entropy is unbounded). Its costs carry their own
scale (a weight per sample is a scale of its row), and they are not constrained in sign.

With w = 1, one-hot t, d = 0 and the CE head this is the plain batch-mean cross-entropy. pFedGRP's alignment
term (Eq. 6) is the teacher term with d_i = lambda for samples of classes seen before. The BCE head averages
over the visible classes (hidden ones neither pull nor push); softplus is written as relu(r) + log(1 + exp(r -
2 relu(r))), which is exact, stable, and made of ops whose gradients ORT's graph builder has.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from models.zoo import MASK_FILL, ClassifierModel


def _softplus(r: torch.Tensor) -> torch.Tensor:
    positive = torch.relu(r)
    return positive + torch.log(1.0 + torch.exp(r - 2.0 * positive))


def training_loss(
    raw: torch.Tensor,
    class_mask: torch.Tensor,
    targets: torch.Tensor,
    sample_weights: torch.Tensor,
    teacher_logits: torch.Tensor,
    teacher_weights: torch.Tensor,
    soft_targets: torch.Tensor,
    soft_weights: torch.Tensor,
    class_costs: torch.Tensor,
    bce: torch.Tensor,
) -> torch.Tensor:
    """The batch loss of the module docstring from raw (unmasked) logits."""
    visible = class_mask.sum().clamp(min=1.0)
    masked = raw + (class_mask - 1.0) * MASK_FILL
    log_p = F.log_softmax(masked, dim=1)
    ce = -(targets * log_p).sum(1)
    binary = ((_softplus(raw) - targets * raw) * class_mask).sum(1) / visible
    head = bce.reshape(())
    task = (1.0 - head) * ce + head * binary
    distance = ((raw - teacher_logits) * class_mask).pow(2).sum(1) / visible
    soft = -(soft_targets * class_mask * log_p).sum(1)  # hidden classes: no target (their log p is -1e9)
    cost = (class_costs * class_mask * torch.exp(log_p)).sum(1)  # hidden classes: probability exactly 0
    return (sample_weights * (task + teacher_weights * distance) + soft_weights * soft + cost).mean()


def plain_training_loss(raw: torch.Tensor, class_mask: torch.Tensor, targets: torch.Tensor,
                        sample_weights: torch.Tensor) -> torch.Tensor:
    """`training_loss` where every other term is at its neutral value (no teacher, no soft targets, no class
    costs, the softmax head): the weighted mean softmax cross-entropy over the visible classes, with the same floats
    (the terms left out add exact zeros) from half the graph (models/manifest.py PLAIN_GRADIENT)."""
    log_p = F.log_softmax(raw + (class_mask - 1.0) * MASK_FILL, dim=1)
    return (sample_weights * -(targets * log_p).sum(1)).mean()


class TrainingGraph(torch.nn.Module):
    """The classifier and its loss as one module: what the ORT training and eval graphs are exported from.
    forward(input, class_mask, *LOSS_INPUTS) -> (loss, masked logits, features). It holds the classifier's own
    trunk and head, so its parameters keep the classifier's names (the manifest's)."""

    def __init__(self, model: ClassifierModel) -> None:
        super().__init__()
        self.trunk = model.trunk
        self.head = model.head

    def forward(
        self,
        x: torch.Tensor,
        class_mask: torch.Tensor,
        targets: torch.Tensor,
        sample_weights: torch.Tensor,
        teacher_logits: torch.Tensor,
        teacher_weights: torch.Tensor,
        soft_targets: torch.Tensor,
        soft_weights: torch.Tensor,
        class_costs: torch.Tensor,
        bce: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        raw = self.head(features)
        loss = training_loss(raw, class_mask, targets, sample_weights, teacher_logits, teacher_weights, soft_targets,
                             soft_weights, class_costs, bce)
        return loss, raw + (class_mask - 1.0) * MASK_FILL, features
