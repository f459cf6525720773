"""GLFC's costs on a device and what its proxy's gradient inversion exposes (docs/methods/glfc.md).

Device cost (`--part cost`): one device's learner on class-incremental digits (two tasks of two classes, M = 60,
E = 10, AdamW 3e-3, the ort backend), GLFC against the same learner with a random cache and the plain loss, each
round timed (CPU seconds of this process, the best of `--repeats`): the extra eval forward pass per batch of the
gradient compensation, the old model's forward pass over the round's samples, and at the task switch the herding
ranking, the old model's file and the prototype gradients; the bytes each round uploads and downloads (the model,
the prototype gradients, the broadcast old model once per task) and what the device stores under M, per holder.

Exposure (`--part privacy`): what an honest-but-curious coordinator learns from one prototype gradient, with the
prototype as it is, perturbed as the paper defines it (the policy's defaults: Eqs. 10-11, CE with noise on the
features) and as the authors' code perturbs it (`PERTURBATIONS`), and the paper's perturbed gradients as local DP
releases them (`LOCAL_DP_SIGMAS`). A device's local model (LeNet, or the 1-D CNN,
`LOCAL_EPOCHS` of AdamW on every training sample) gives each class's prototype, the training sample nearest the
class's mean feature, as the policy picks it, and is what the perturbation descends through. The sample sent goes
through Gamma; the proxy's reconstruction (`GlfcProxy.reconstruct`, L-BFGS, the strategy's defaults) is scored by a
classifier trained on the real training data (scikit-learn's logistic regression: the share of reconstructions it
labels as their class, beside its score on the raw prototypes themselves), by its distance to the nearest real
training sample of its class against a real test sample's distance to its nearest training neighbour (a
reconstruction much nearer than that is a copy of a training sample), and by its distance to the raw prototype,
the device's real sample (`moved`: how far the perturbation took the sample sent from it).

Compensation (`--part compensation`): why the class-aware gradient compensation costs GLFC accuracy on MNIST-1D
and not on digits (docs/results.md). One device's learner, no federation, so only the loss differs: two tasks of
two classes (`--samples` of each class, M = 60, E = 10, 3 rounds a task, the ort backend), GLFC with and without
compensation from the same start, per seed: accuracy (under the mask of the classes seen) on the new task's and
the old task's test samples, and in task 1 the weights' spread (`WeightSpread`: effective sample share, the share
of the weight on the unlearnt samples (their label's sigmoid below 0.5), and those samples' share).

    .venv/bin/python benchmarks/glfc.py [--part cost|privacy|compensation|all] [--repeats 3] [--seeds 0,1,2,3,4]
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


def _learner(artifacts: Path, folder: Path, policy: str, options: dict, seed: int = 0) -> Learner:
    shape = tuple(load_manifest(artifacts).input_shape)
    store = ReplayStore.within(DeviceBudget(Budget(60, None)), folder / "store", shape)
    learner = Learner(OrtTrainer(artifacts, optimizer="adamw", lr=3e-3), store, make_policy(policy, **options),
                      LearnerConfig(epochs=10, batch_size=32), seed=seed)
    learner.open_policy(folder, artifacts)
    return learner


def device_cost(repeats: int) -> None:
    data = load_dataset("digits")
    with tempfile.TemporaryDirectory() as root:
        artifacts = Path(root) / "lenet"
        # the portable graphs too: GLFC's prototype perturbation runs the input gradient, which ort takes from them
        export_registered("lenet", 10, artifacts, input_shape=(1, 8, 8), seed=0, backends=("ort", "torch", "portable"))
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


# The prototype a device uploads: as it is, perturbed as the paper defines it (the policy's defaults), and as the
# authors' code does (BCE, no feature noise, lr 0.2)
PERTURBATIONS: dict[str, dict[str, float | str]] = {
    "none": {"refine_steps": 0}, "paper": {},
    "code": {"refine_loss": "bce", "refine_noise": 0.0, "refine_lr": 0.2}}
LOCAL_EPOCHS = 10  # the local model the perturbation descends through: AdamW 3e-3 on every training sample
# The paper's perturbation, then local DP's release (edge_client/privacy.py) at these noise multipliers, clip 1: the
# round's prototype gradients as the device sends them under `[privacy] mode = "local"`, released with its weights.
# Here they are released alone, taking the whole clip: the attacker's best case (the weights' change takes part of it)
LOCAL_DP_SIGMAS = (0.1, 1.0)


def exposure() -> None:
    import torch
    from sklearn.linear_model import LogisticRegression
    from torch.nn import functional as F

    from coordinator.background import Deadline
    from coordinator.strategies import make_strategy
    from edge_client.policies.base import RoundView
    from edge_client.trainers.portable import PortableTrainer
    from models.zoo import build_model

    print("Reconstructions from one prototype gradient (honest-but-curious coordinator), per perturbation")
    print(f"  {'data':8s} {'gamma':11s} {'perturbed':9s} {'moved':>6s} {'recognised':>10s} {'(prototypes)':>12s} "
          f"{'to nearest train':>16s} {'test to nearest':>15s} {'to prototype':>12s} {'label right':>11s}")
    for dataset, gammas in GAMMAS.items():
        data = load_dataset(dataset)
        shape = tuple(data.x_train.shape[1:])
        flat_train = data.x_train.reshape(len(data.x_train), -1)
        classifier = LogisticRegression(max_iter=2000).fit(flat_train, data.y_train)
        test_nearest = np.mean([np.linalg.norm(flat_train[data.y_train == c] - t.reshape(-1), axis=1).min()
                                for t, c in zip(data.x_test[:200], data.y_test[:200])])
        classes = np.unique(data.y_train)
        with tempfile.TemporaryDirectory() as root:
            artifacts = Path(root) / "model"
            export_registered("lenet" if len(shape) == 3 else "cnn1d", len(classes), artifacts, input_shape=shape,
                              seed=0, backends=("torch", "portable"))
            local = PortableTrainer(artifacts, optimizer="adamw", lr=3e-3)  # the device's trained model
            local.fit(data.x_train, data.y_train, epochs=LOCAL_EPOCHS, batch_size=32)
            _, features = local.outputs(data.x_train, data.y_train)
            raw, spreads = [], []
            for c in classes:  # the policy's prototype: the member nearest its class's mean feature
                members = np.flatnonzero(data.y_train == c)
                centre = features[members].mean(axis=0)
                raw.append(data.x_train[members[np.linalg.norm(features[members] - centre, axis=1).argmin()]])
                spreads.append(features[members].std(axis=0))
            for perturbation, options in PERTURBATIONS.items():
                policy = make_policy("glfc", **options)
                view = RoundView.of_samples(local, None, None, np.random.default_rng(0))
                sent = np.stack([policy._refined(view, x[None], int(c), spread)[0]  # type: ignore[attr-defined]
                                 for x, c, spread in zip(raw, classes, spreads)])
                moved = float(np.mean(np.linalg.norm((sent - np.stack(raw)).reshape(len(classes), -1), axis=1)))
                for gamma_name in gammas:
                    proxy = make_strategy("glfc", device="auto", manifest=load_manifest(artifacts), gamma=gamma_name,
                                          input_range=(float(data.x_train.min()), float(data.x_train.max())))
                    gamma = build_model(gamma_name, len(classes), shape, seed=2021)
                    gradients = []
                    for x, c in zip(sent, classes):
                        logits, _ = gamma(torch.from_numpy(x[None]))
                        grads = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([int(c)])),
                                                    list(gamma.parameters()))
                        gradients.append(torch.cat([g.reshape(-1) for g in grads]).numpy())
                    released = {perturbation: gradients}
                    if perturbation == "paper":
                        released.update({f"+ldp-z{z:g}": local_release(gradients, z) for z in LOCAL_DP_SIGMAS})
                    for name, sent_gradients in released.items():
                        made, labels = proxy.reconstruct(sent_gradients, Deadline(600))
                        flat = made.reshape(len(made), -1)
                        recognised = float((classifier.predict(flat) == classes).mean())
                        reference = float((classifier.predict(np.stack(raw).reshape(len(classes), -1)) == classes)
                                          .mean())
                        nearest = np.mean([np.linalg.norm(flat_train[data.y_train == c] - m, axis=1).min()
                                           for m, c in zip(flat, classes)])
                        to_prototype = np.mean(np.linalg.norm(flat - np.stack(raw).reshape(len(classes), -1), axis=1))
                        print(f"  {dataset:8s} {gamma_name:11s} {name:9s} {moved:6.3f} {recognised:10.2f} "
                              f"{reference:12.2f} {nearest:16.3f} {test_nearest:15.3f} {to_prototype:12.3f} "
                              f"{float((labels == classes).mean()):11.2f}", flush=True)


def local_release(gradients: list[np.ndarray], sigma: float) -> list[np.ndarray]:
    """Prototype gradients as local DP releases them (clip 1, noise multiplier `sigma`), through the device's own
    release and GLFC's own encoding (`ReplayPolicy.attached_values`), with no weight change beside them."""
    from edge_client.policies.base import AttachedValues
    from edge_client.privacy import LocalPrivacy, LocalPrivacySettings
    from models.glfc import encode_gradient

    ends = np.cumsum([len(g) for g in gradients])
    attached = AttachedValues(np.concatenate(gradients).astype(np.float64),
                              lambda v: {str(k): encode_gradient(p) for k, p in enumerate(np.split(v, ends[:-1]))})
    with tempfile.TemporaryDirectory() as folder:
        privacy = LocalPrivacy(LocalPrivacySettings(mode="local", noise_multiplier=sigma, noise_seed=0), Path(folder))
        _, out = privacy.release(np.zeros(0, np.float32), np.zeros(0, np.float32), attached)
    assert out is not None
    return [np.frombuffer(out[str(k)], dtype="<f4").copy() for k in range(len(gradients))]


COMPENSATION_MODELS = {"digits": ("lenet", (1, 8, 8)), "mnist1d": ("cnn1d", (1, 40))}
RELATIONS = ("kl", "bce")  # GLFC (the paper's relation form) and its "w/o CRD" row (the authors' code's form)
SPREAD = ("compensation_ess", "compensation_on_unlearnt", "unlearnt")


def compensation_study(seeds: list[int], samples: int) -> None:
    tasks = ([0, 1], [2, 3])
    print(f"Compensation on one device: GLFC with and without it, {len(seeds)} seeds, {samples} samples a class, "
          "accuracy % (mean ± std) on the new task's and the old task's test classes after task 1")
    for dataset, (model, shape) in COMPENSATION_MODELS.items():
        data = load_dataset(dataset)
        acc: dict[str, list[tuple[float, float]]] = {f"{relation}, {variant}": [] for relation in RELATIONS
                                                    for variant in ("with", "without")}
        spread: dict[str, list[list[float]]] = {relation: [] for relation in RELATIONS}
        with tempfile.TemporaryDirectory() as root:
            for seed in seeds:
                artifacts = Path(root) / f"{model}-{seed}"
                export_registered(model, 10, artifacts, input_shape=shape, seed=seed,
                                  backends=("ort", "torch", "portable"))
                POLICIES.get("glfc").export_artifacts({"gamma": "glfc_mlp"}, artifacts)
                for variant in acc:
                    relation, compensation = variant.split(", ")
                    options = {"gamma": "glfc_mlp", "compensation": compensation == "with", "relation": relation}
                    folder = Path(root) / f"{dataset}-{seed}-{relation}-{compensation}"
                    learner = _learner(artifacts, folder, "glfc", options, seed)
                    rng = np.random.default_rng(seed)
                    round_metrics = []
                    for task, classes in enumerate(tasks):
                        learner.global_model_arrived(learner.trainer.get_weights())
                        pick = np.concatenate([rng.permutation(np.flatnonzero(data.y_train == c))[:samples]
                                               for c in classes])
                        learner.start_task(task, data.x_train[pick], data.y_train[pick])
                        for _ in range(3):
                            learner.train()
                            learner.finish_round()
                            round_metrics.append(learner.policy.metrics())
                    mask = np.zeros(10, dtype=bool)
                    mask[[c for classes in tasks for c in classes]] = True
                    scores = []
                    for classes in (tasks[1], tasks[0]):
                        part = np.isin(data.y_test, classes)
                        scores.append(100 * learner.trainer.evaluate(data.x_test[part], data.y_test[part],
                                                                     class_mask=mask).accuracy)
                    acc[variant].append((scores[0], scores[1]))
                    if compensation == "with":
                        spread[relation].append([float(np.mean([m[k] for m in round_metrics[3:]])) for k in SPREAD])
                    learner.store.close()
        print(f"  {dataset} ({model})")
        for variant, rows in acc.items():
            new, old = np.array(rows).T
            print(f"    {variant + ' compensation':26s} new {new.mean():6.2f} ± {new.std(ddof=1):5.2f}   "
                  f"old {old.mean():6.2f} ± {old.std(ddof=1):5.2f}   mean {((new + old) / 2).mean():6.2f}")
        for relation in RELATIONS:
            diff = np.array(acc[f"{relation}, with"]) - np.array(acc[f"{relation}, without"])
            for k, name in enumerate(("new", "old")):
                d = diff[:, k]
                t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d))) if d.std(ddof=1) > 0 else 0.0
                print(f"    {relation}: with - without, {name} task: " + " ".join(f"{v:+.2f}" for v in d)
                      + f"; mean {d.mean():+.2f}, paired t = {t:.2f}")
            mean_spread = np.mean(spread[relation], axis=0)
            print(f"    {relation}: task 1 weights: " + ", ".join(f"{k} {v:.3f}" for k, v in zip(SPREAD, mean_spread)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("cost", "privacy", "compensation", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--samples", type=int, default=100, help="samples of each class (compensation)")
    args = parser.parse_args()
    if args.part in ("cost", "all"):
        device_cost(args.repeats)
    if args.part in ("privacy", "all"):
        exposure()
    if args.part in ("compensation", "all"):
        compensation_study([int(s) for s in args.seeds.split(",")], args.samples)


if __name__ == "__main__":
    main()
