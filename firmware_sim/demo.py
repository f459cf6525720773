"""The README's main job. For now one device: export LeNet to ORT training artifacts and train it on the embedded
digits through ONNX Runtime, printing test accuracy after each epoch. (The fleet demo replaces it later.)"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge_client.trainers.ort import OrtTrainer
from firmware_sim.datasets import load_dataset
from models.export import export_registered

DEMO_MODEL = "lenet"
DEMO_OPTIMIZER = "adamw"
DEMO_LR = 3e-3
DEMO_BATCH = 32


def run_local_demo(out_dir: str | Path = "runs/demo", epochs: int = 8, seed: int = 0) -> dict:
    out = Path(out_dir)
    data = load_dataset("digits", seed=seed)
    artifacts = out / "artifacts"
    manifest = export_registered(DEMO_MODEL, data.num_classes, artifacts, input_shape=data.input_shape, seed=seed)
    print(f"exported {manifest.model}: {manifest.num_parameters:,} parameters -> {artifacts}")
    trainer = OrtTrainer(artifacts, optimizer=DEMO_OPTIMIZER, lr=DEMO_LR)
    rng = np.random.default_rng(seed)
    history = []
    print(f"training on {len(data.y_train)} digits, testing on {len(data.y_test)} (ONNX Runtime Training)")
    for epoch in range(1, epochs + 1):
        loss = trainer.fit(data.x_train, data.y_train, epochs=1, batch_size=DEMO_BATCH, rng=rng)
        result = trainer.evaluate(data.x_test, data.y_test)
        history.append({"epoch": epoch, "train_loss": loss, "test_loss": result.loss, "test_accuracy": result.accuracy})
        print(f"epoch {epoch:2d}  train loss {loss:.4f}  test accuracy {result.accuracy:.2%}")
    results = {"model": DEMO_MODEL, "dataset": data.name, "history": history}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"final test accuracy {history[-1]['test_accuracy']:.2%}; results in {out / 'results.json'}")
    return results
