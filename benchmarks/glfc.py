"""GLFC's costs on a device and what its proxy's gradient inversion exposes (docs/methods/glfc.md).

Device cost (`--part cost`): one device's learner on class-incremental digits (two tasks of two classes, M = 60,
E = 10, AdamW 3e-3, the ort backend), GLFC against the same learner with a random cache and the plain loss, each
round timed (CPU seconds of this process, the best of `--repeats`): the extra eval forward pass per batch of the
gradient compensation, the old model's forward pass over the round's samples, and at the task switch the herding
ranking, the old model's file and the prototype gradients; the bytes each round uploads and downloads (the model,
the prototype gradients, the broadcast old model once per task) and what the device stores under M, per holder.

Exposure (`--part privacy`): what an honest-but-curious coordinator learns from one prototype gradient. For each
class, the sample a device would upload (nearest its class mean in the input space here: no trained model
needed) goes through Gamma; the proxy's reconstruction (`GlfcProxy.reconstruct`, L-BFGS, the strategy's
defaults) is scored by a classifier trained on the real training data (scikit-learn's logistic regression:
the share of reconstructions it labels as their class, beside its score on the uploaded prototypes themselves), by its distance to the nearest real training sample of its
class against a real test sample's distance to its nearest training neighbour (a reconstruction much nearer than
that is a copy of a training sample), and by its distance to the uploaded prototype itself.

    .venv/bin/python benchmarks/glfc.py [--part cost|privacy|both] [--repeats 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from edge_client.budget import Budget, DeviceBudget
from edge_client.learner import Learner, LearnerConfig
from edge_client.policies import POLICIES, make_policy
from edge_client.store import ReplayStore
from edge_client.trainers.ort import OrtTrainer
from firmware_sim.datasets import load_dataset
from models.export import export_registered
from models.glfc import encode_old_model
from models.manifest import load_manifest

GAMMAS = {"digits": ("glfc_mlp", "glfc_lenet"), "mnist1d": ("glfc_mlp",)}


def _classes(data, classes, n):
    pick = np.flatnonzero(np.isin(data.y_train, classes))[:n]
    return data.x_train[pick], data.y_train[pick]


def _learner(artifacts: Path, folder: Path, policy: str, options: dict) -> Learner:
    store = ReplayStore.within(DeviceBudget(Budget(60, None)), folder / "store", (1, 8, 8))
    learner = Learner(OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), store, make_policy(policy, **options),
                      LearnerConfig(epochs=10, batch_size=32), seed=0)
    learner.open_policy(folder, artifacts)
    return learner


def device_cost(repeats: int) -> None:
    data = load_dataset("digits")
    with tempfile.TemporaryDirectory() as root:
        artifacts = Path(root) / "lenet"
        export_registered("lenet", 10, artifacts, input_shape=(1, 8, 8), seed=0, backends=("ort", "torch"))
        options = {"gamma": "glfc_mlp"}
        POLICIES.get("glfc").export_artifacts(options, artifacts)
        model_bytes = 4 * load_manifest(artifacts).num_parameters
        rows = []
        for name, policy, opts in (("random + plain loss", "random", {}), ("glfc", "glfc", options)):
            best: dict[str, float] = {}
            for r in range(repeats):
                learner = _learner(artifacts, Path(root) / f"{name}-{r}", policy, opts)
                weights = learner.trainer.get_weights()
                timings, uploads, downloads, forwards = {}, {}, {}, {}
                for task, classes in enumerate(([0, 1], [2, 3])):
                    learner.global_model_arrived(weights)
                    if task and policy == "glfc":  # the proxy's old model, once per task
                        learner.policy.receive(learner.view(), encode_old_model(weights, task - 1))
                    started = time.process_time()
                    learner.start_task(task, *_classes(data, classes, 40))
                    switch = time.process_time() - started
                    for round_ in range(2):
                        started = time.process_time()
                        learner.train()
                        learner.finish_round()
                        key = f"task {task} round {round_}"
                        timings[key] = time.process_time() - started + (switch if round_ == 0 else 0.0)
                        attached = learner.policy.attachments(learner.view())
                        uploads[key] = model_bytes + sum(len(v) for v in attached.values())
                        downloads[key] = model_bytes + (model_bytes + 8 if task and round_ == 0 and
                                                        policy == "glfc" else 0)
                        forwards[key] = learner.policy.metrics().get("extra_forward_passes", 0.0)
                        weights = learner.trainer.get_weights()
                held = learner.budget.held()
                learner.store.close()
                for key, value in timings.items():
                    best[key] = min(best.get(key, np.inf), value)
            rows.append((name, best, uploads, downloads, forwards, held))
        base = rows[0][1]
        print(f"Device cost per round (CPU s, best of {repeats}; ratio to the random cache's round)")
        print(f"  {'method':22s} {'round':16s} {'cpu s':>7s} {'ratio':>6s} {'extra fwd':>9s} {'up B':>8s} "
              f"{'down B':>8s}")
        for name, best, uploads, downloads, forwards, _ in rows:
            for key in best:
                print(f"  {name:22s} {key:16s} {best[key]:7.3f} {best[key] / base[key]:6.2f} {forwards[key]:9.0f} "
                      f"{uploads[key]:8d} {downloads[key]:8d}")
        print("Stored under M at the end (bytes, per holder)")
        for name, *_, held in rows:
            print(f"  {name:22s} " + ", ".join(f"{k} {v}" for k, v in held.items()))


def exposure() -> None:
    import torch
    from sklearn.linear_model import LogisticRegression
    from torch.nn import functional as F

    from coordinator.background import Deadline
    from coordinator.strategies import make_strategy
    from models.zoo import build_model

    print("Reconstructions from one prototype gradient (honest-but-curious coordinator)")
    print(f"  {'data':8s} {'gamma':11s} {'recognised':>10s} {'(prototypes)':>12s} {'to nearest train':>16s} "
          f"{'test to nearest':>15s} {'to prototype':>12s} {'label right':>11s}")
    for dataset, gammas in GAMMAS.items():
        data = load_dataset(dataset)
        shape = tuple(data.x_train.shape[1:])
        flat_train = data.x_train.reshape(len(data.x_train), -1)
        classifier = LogisticRegression(max_iter=2000).fit(flat_train, data.y_train)
        test_nearest = np.mean([np.linalg.norm(flat_train[data.y_train == c] - t.reshape(-1), axis=1).min()
                                for t, c in zip(data.x_test[:200], data.y_test[:200])])
        classes = np.unique(data.y_train)
        prototypes = []
        for c in classes:
            members = data.x_train[data.y_train == c].reshape(-1, flat_train.shape[1])
            prototypes.append(members[np.linalg.norm(members - members.mean(0), axis=1).argmin()].reshape(shape))
        for gamma_name in gammas:
            with tempfile.TemporaryDirectory() as root:
                artifacts = Path(root) / "model"
                export_registered("lenet" if len(shape) == 3 else "cnn1d", len(classes), artifacts,
                                  input_shape=shape, seed=0, backends=("torch",))
                proxy = make_strategy("glfc", device="auto", manifest=load_manifest(artifacts), gamma=gamma_name,
                                      input_range=(float(data.x_train.min()), float(data.x_train.max())))
            gamma = build_model(gamma_name, len(classes), shape, seed=2021)
            gradients = []
            for x, c in zip(prototypes, classes):
                logits, _ = gamma(torch.from_numpy(x[None]))
                grads = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([int(c)])), list(gamma.parameters()))
                gradients.append(torch.cat([g.reshape(-1) for g in grads]).numpy())
            made, labels = proxy.reconstruct(gradients, Deadline(600))
            flat = made.reshape(len(made), -1)
            recognised = float((classifier.predict(flat) == classes).mean())
            reference = float((classifier.predict(np.stack(prototypes).reshape(len(classes), -1)) == classes).mean())
            nearest = np.mean([np.linalg.norm(flat_train[data.y_train == c] - m, axis=1).min()
                               for m, c in zip(flat, classes)])
            to_prototype = np.mean(np.linalg.norm(flat - np.stack(prototypes).reshape(len(classes), -1), axis=1))
            print(f"  {dataset:8s} {gamma_name:11s} {recognised:10.2f} {reference:12.2f} {nearest:16.3f} {test_nearest:15.3f} "
                  f"{to_prototype:12.3f} {float((labels == classes).mean()):11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("cost", "privacy", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("cost", "both"):
        device_cost(args.repeats)
    if args.part in ("privacy", "both"):
        exposure()


if __name__ == "__main__":
    main()
