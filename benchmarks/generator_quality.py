"""Do pFedGRP's class generators generate their class? The share of generated samples that a classifier trained on
the real data recognises as the class they were generated for, on the embedded digits (1, 8, 8), MNIST-1D (1, 40)
and Fashion-MNIST (1, 28, 28, at the presets' `FASHION_SCALE`), per generator kind (models/generators.py) and step count.

Per seed: the reference classifier (the runtime's model for the dataset, LeNet or the 1-D CNN, trained with the
torch trainer on every training sample; its test accuracy is printed, the ceiling of what "recognised" can mean);
then for each class a generator trained from scratch on `--per-class` of its training samples (about what one
device holds of a class) with the device's own trainer (`make_generator_trainer`, torch), `--samples` drawn from
it, and the share the reference classifies as that class. `gaussian` is a per-class diagonal Gaussian fitted to
the same samples (no training): the floor a generator must beat to be worth its bytes. Also printed: each kind's
sampler and auxiliary sizes (values), what a device stores per class.

A kind may name its base width, `conv-vae:8` (default: `default_spec`'s). `--precisions float32,int8` samples each
trained generator once per precision the bank may store it at (its weights quantized through the record format,
the same draws of z): whether int8 loses anything a classifier can see.

    .venv/bin/python benchmarks/generator_quality.py [--datasets digits,mnist1d,fashion] [--kinds vae,conv-vae,wgan-gp]
        [--steps 200,1000] [--seeds 0,1,2] [--per-class 64] [--samples 200] [--precisions float32,int8]
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from edge_client.generators.choice import make_generator_trainer
from edge_client.trainers.pytorch import TorchTrainer
from firmware_sim.array_dataset import ArrayDataset
from firmware_sim.datasets import load_digits_dataset, load_fashion_mnist, load_mnist1d
from firmware_sim.scenarios import FASHION_SCALE
from models.export import export_registered
from models.generator_record import GeneratorRecord, quantize
from models.generators import GeneratorSpec, auxiliary_size, build_sampler, default_spec, load_module, sampler_size
from models.manifest import load_manifest

DATASETS: dict[str, tuple[str, Callable[[], ArrayDataset]]] = {
    "digits": ("lenet", load_digits_dataset), "mnist1d": ("cnn1d", load_mnist1d),
    "fashion": ("lenet", lambda: load_fashion_mnist(**FASHION_SCALE))}


def reference_classifier(dataset: ArrayDataset, model: str, seed: int, epochs: int, folder: str) -> TorchTrainer:
    export_registered(model, dataset.num_classes, folder, dataset.input_shape, seed=seed, backends=("torch",))
    trainer = TorchTrainer(load_manifest(folder), optimizer="adamw", lr=3e-3, seed=seed)
    trainer.fit(dataset.x_train, dataset.y_train, epochs=epochs, batch_size=64, rng=np.random.default_rng(seed))
    return trainer


def spec_of(kind: str, shape: tuple[int, ...]) -> GeneratorSpec:
    """`default_spec(kind, shape)`, or with the width `kind` names after a colon (`conv-vae:8`)."""
    name, _, width = kind.partition(":")
    spec = default_spec(name, shape)
    return dataclasses.replace(spec, width=int(width)) if width else spec


def generated(kind: str, x: np.ndarray, steps: int, n: int, rng: np.random.Generator,
              precisions: tuple[str, ...] = ("float32",)) -> dict[str, np.ndarray]:
    """n samples of a generator of `kind` trained once from scratch on x, per precision the bank may store its
    weights at (quantized through the record format, the same draws of z for each), or of a diagonal Gaussian
    fitted to x."""
    if kind == "gaussian":
        mean, std = x.mean(0), x.std(0)
        return {"float32": (mean + std * rng.standard_normal((n, *x.shape[1:]))).astype(np.float32)}
    import torch

    spec = spec_of(kind, x.shape[1:])
    trained, _ = make_generator_trainer(spec.to_dict(), "torch").train(x, None, steps, rng)
    z = torch.from_numpy(rng.standard_normal((n, spec.latent_dim)).astype(np.float32))
    samples = {}
    for precision in precisions:
        record = GeneratorRecord(0, spec.to_dict(), "float32", np.asarray(trained, np.float32), None, len(x), steps)
        sampler = build_sampler(spec).eval()
        load_module(sampler, quantize(record, precision).sampler)
        with torch.no_grad():
            samples[precision] = sampler(z).numpy()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="digits,mnist1d")
    parser.add_argument("--kinds", default="gaussian,vae,conv-vae,wgan-gp")
    parser.add_argument("--steps", default="200,1000", help="generator steps from scratch (the paper: 1000)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--per-class", type=int, default=64, help="training samples of a class per generator")
    parser.add_argument("--samples", type=int, default=200, help="generated samples per class")
    parser.add_argument("--reference-epochs", type=int, default=30)
    parser.add_argument("--precisions", default="float32", help="the bank's precisions to sample at, e.g. "
                        "float32,int8 (each generator trained once, quantized as the bank stores it)")
    args = parser.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds, steps_list = args.kinds.split(","), [int(s) for s in args.steps.split(",")]
    precisions = tuple(args.precisions.split(","))
    for name in args.datasets.split(","):
        model, load = DATASETS[name]
        dataset = load()
        shape = dataset.input_shape
        sizes = ", ".join(f"{k} {sampler_size(spec_of(k, shape))} + {auxiliary_size(spec_of(k, shape))}"
                          for k in kinds if k != "gaussian")
        print(f"\n{name} {shape}: share of generated samples the real-data classifier recognises, %, mean ± std over "
              f"seeds {seeds}; {args.per_class} training samples per class; sampler + auxiliary values: {sizes}",
              flush=True)
        shares: dict[tuple[str, int], list[float]] = {}
        for seed in seeds:
            with tempfile.TemporaryDirectory() as folder:
                reference = reference_classifier(dataset, model, seed, args.reference_epochs, folder)
            accuracy = reference.evaluate(dataset.x_test, dataset.y_test).accuracy
            print(f"  seed {seed}: reference classifier test accuracy {100 * accuracy:.1f} %", flush=True)
            rng = np.random.default_rng(seed)
            for kind in kinds:
                for steps in ([0] if kind == "gaussian" else steps_list):
                    started = time.monotonic()
                    hits: dict[str, int] = {}
                    for c in range(dataset.num_classes):
                        pool = np.flatnonzero(dataset.y_train == c)
                        x = dataset.x_train[rng.choice(pool, min(args.per_class, len(pool)), replace=False)]
                        for precision, fake in generated(kind, x, steps, args.samples, rng, precisions).items():
                            logits = reference.teacher_logits(reference.get_weights(), fake)
                            hits[precision] = hits.get(precision, 0) + int((logits.argmax(1) == c).sum())
                    for precision, hit in hits.items():
                        share = 100 * hit / (args.samples * dataset.num_classes)
                        shares.setdefault((kind, steps, precision), []).append(share)
                        print(f"    {kind:9s} {steps:5d} steps {precision:8s}: {share:5.1f} %  "
                              f"({time.monotonic() - started:.0f} s)", flush=True)
        for (kind, steps, precision), values in shares.items():
            label = kind if kind == "gaussian" else f"{kind}, {steps} steps, {precision}"
            print(f"  {label:22s} {np.mean(values):5.1f} ± {np.std(values):4.1f}   "
                  f"({' '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
