"""The torch backend: the reference the other two are tested against, and the fallback where neither ONNX
Runtime build is installed (or for the pFedGRP GAN generator, which only torch trains).

It rebuilds the manifest's architecture from the model zoo and exchanges the same flat buffer as the other
backends. Its optimisers match theirs: SGD (with optional momentum), and AdamW with eps 1e-6 and no weight decay.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from edge_client.trainers.base import LossInputs, Trainer, iterate_batches, loss_arrays
from models.flat_weights import flatten_weights, load_flat_weights
from models.loss import training_loss
from models.manifest import Manifest
from models.zoo import build_for


class TorchTrainer(Trainer):
    backend = "torch"

    def __init__(
        self,
        manifest: Manifest,
        optimizer: str = "sgd",
        lr: float = 0.01,
        device: str = "cpu",
        seed: int = 0,
        momentum: float = 0.0,
        threads: int | None = None,
    ) -> None:
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)  # per process: a device daemon is one; a fleet worker's devices share it
        self.manifest = manifest
        self.device = torch.device(device)
        self.model = build_for(manifest, seed=seed).to(
            self.device
        )
        params = self.model.parameters()
        if optimizer == "sgd":
            self._optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
        elif optimizer == "adamw":
            self._optimizer = torch.optim.AdamW(params, lr=lr, eps=1e-6, weight_decay=0.0)
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose 'sgd' or 'adamw'")
        self.set_learning_rate(lr)

    def get_weights(self) -> np.ndarray:
        return flatten_weights(self.model, self.manifest)

    def set_weights(self, buffer: np.ndarray) -> None:
        load_flat_weights(self.model, self.manifest, self.check_weights(buffer))

    def reset_optimizer(self) -> None:
        """torch's optimisers make a parameter's state (and AdamW's step count) at its first step when they hold
        none: emptied, the next step is a new optimiser's."""
        self._optimizer.state.clear()

    def _apply_learning_rate(self, lr: float) -> None:
        for group in self._optimizer.param_groups:
            group["lr"] = lr

    def _step(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> float:
        return self.train_step_with(x, y, class_mask, loss)[0]

    def train_step_with(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None = None,
        extra: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[float, float]:
        """One optimiser step on the training loss plus `extra(features)`, a differentiable term of the trunk's
        output (torch only: an adversary on the features, say). The backward pass also fills the .grad of any
        module `extra` runs, for its owner's optimiser; this trainer steps only the model, at the learning rate
        (its caller settles the step: `settle_step`). Returns the training loss and the extra term, before the
        step."""
        self.model.train()
        self._optimizer.zero_grad(set_to_none=True)
        raw, features = self.model(self._tensor(x))
        inputs = (self._tensor(a) for a in loss_arrays(y, self.manifest.num_classes, loss))
        value = training_loss(raw, self._tensor(class_mask), *inputs)
        term = extra(features) if extra is not None else torch.zeros(())
        (value + term).backward()
        self._optimizer.step()
        return float(value.item()), float(term.item())

    def _gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        """torch.autograd.grad of the training loss, in train mode as train_step: the parameters' .grad and the
        optimiser are left alone."""
        self.model.train()
        params = dict(self.model.named_parameters())
        raw, _ = self.model(self._tensor(x))
        inputs = (self._tensor(a) for a in loss_arrays(y, self.manifest.num_classes, loss))
        value = training_loss(raw, self._tensor(class_mask), *inputs)
        grads = torch.autograd.grad(value, [params[p.name] for p in self.manifest.parameters])
        flat = np.concatenate([g.detach().cpu().numpy().ravel() for g in grads])
        return float(value.item()), flat.astype(np.float32, copy=False)

    def _input_gradient(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, loss: LossInputs | None
    ) -> tuple[float, np.ndarray]:
        """torch.autograd.grad of the training loss w.r.t. the inputs, in train mode as `_gradient`."""
        self.model.train()
        inputs = self._tensor(x).requires_grad_(True)
        raw, _ = self.model(inputs)
        terms = (self._tensor(a) for a in loss_arrays(y, self.manifest.num_classes, loss))
        value = training_loss(raw, self._tensor(class_mask), *terms)
        (gradient,) = torch.autograd.grad(value, [inputs])
        return float(value.item()), gradient.detach().cpu().numpy().astype(np.float32, copy=False)

    @torch.no_grad()
    def forward(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        self.model.eval()
        logits, features = self.model(self._tensor(x), self._tensor(class_mask))
        loss = F.cross_entropy(logits, self._tensor(y))
        return float(loss.item()), logits.cpu().numpy(), features.cpu().numpy()

    def _exact_grad_norms(
        self, x: np.ndarray, y: np.ndarray, class_mask: np.ndarray, batch_size: int
    ) -> np.ndarray:
        """Per-sample gradients with torch.func (vmap over grad of a batch-of-one loss), `batch_size` samples at
        a time; in train mode, as ORT's training graph computes them. Reads the parameters, never writes them."""
        self.model.train()
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        mask = self._tensor(class_mask)

        def sample_loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            logits, _ = functional_call(self.model, params, (xi[None], mask))
            return F.cross_entropy(logits, yi[None])

        per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))
        norms = np.empty(len(y), dtype=np.float64)
        for idx in iterate_batches(len(y), batch_size, None):
            grads = per_sample_grads(params, self._tensor(x[idx]), self._tensor(y[idx]))
            squared = sum(g.flatten(1).pow(2).sum(1, dtype=torch.float64) for g in grads.values())
            norms[idx] = squared.cpu().numpy()
        return norms

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """`array` as a tensor on the trainer's device; a read-only one (a learner's view holds its class mask so:
        edge_client/learner.py) copied, as torch's tensors are writable."""
        return torch.from_numpy(array if array.flags.writeable else array.copy()).to(self.device)
