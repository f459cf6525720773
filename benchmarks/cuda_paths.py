"""The coordinator's cuda paths timed against its CPU in one run, on one machine: SDD's generator per session
(digits' LeNet, and a paper-sized CIFAR-shaped step), GLFC's proxy reconstruction, and aggregation (FedAvg's
running sum, the coordinate-wise median) at ResNet-18's size. Prints seconds and the CPU/cuda ratio of each, and
checks that cuda and CPU give the same aggregate. Without cuda it times the CPU alone.

    python benchmarks/cuda_paths.py [--parts generator,glfc,aggregation] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def timed(run: Callable[[], Any], device: str) -> float:
    run()  # warm-up (kernels, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def manifest_of(model: str, classes: int, shape: tuple[int, ...]) -> Any:
    from models.manifest import Manifest, ParameterInfo
    from models.zoo import build_model

    net = build_model(model, classes, shape, seed=0)
    parameters = tuple(ParameterInfo(n, tuple(p.shape)) for n, p in net.named_parameters())
    return Manifest(model, shape, classes, net.head.in_features, parameters, 18, 9, False, "bench")


def generator_part(devices: list[str]) -> dict[str, Any]:
    """One session's generator: 5 local models as teachers with their devices' statistics."""
    from coordinator.background import Deadline
    from coordinator.strategies.sdd import GeneratorSettings, model_for, train_generator
    from models.feature_stats import statistics_of

    out: dict[str, Any] = {}
    for label, model, shape, settings in (
        ("digits-lenet 8x8, 10x20 steps of 64", "lenet", (1, 8, 8),
         GeneratorSettings(epochs=10, iterations=20, batch_size=64, warmup_epochs=3)),
        ("cifar-small_cnn 32x32, 2x10 steps of 256", "small_cnn", (3, 32, 32),
         GeneratorSettings(epochs=2, iterations=10, batch_size=256, warmup_epochs=1, ngf=64, nz=256)),
    ):
        manifest = manifest_of(model, 10, shape)
        rng = np.random.default_rng(0)
        weights = [rng.normal(0, 0.05, manifest.num_parameters).astype(np.float32) for _ in range(5)]
        x = rng.random((64, *shape), dtype=np.float32)
        row: dict[str, Any] = {}
        for device in devices:
            torch_device = torch.device(device)
            teachers = [model_for(manifest, w, torch_device) for w in weights]
            stats = []
            for teacher in teachers:
                with torch.no_grad():
                    features = teacher(torch.from_numpy(x).to(torch_device))[1].cpu().numpy()
                stats.append(dict(zip(("input", "features"), statistics_of(x, features))))
            result: dict[str, Any] = {}

            def run(teachers: list = teachers, stats: list = stats, torch_device: torch.device = torch_device,
                    settings: GeneratorSettings = settings, manifest: Any = manifest,
                    result: dict = result) -> None:
                made = train_generator(teachers, stats, (6, 7), settings, manifest, (0.0, 1.0), torch_device,
                                       seed=0, deadline=Deadline(600))
                result["steps"] = made.log["generator_steps"]

            row[device] = {"seconds": timed(run, device), "steps": result["steps"]}
        out[label] = row
    return out


def glfc_part(devices: list[str]) -> dict[str, Any]:
    """The proxy's reconstruction of 4 prototype gradients (L-BFGS, 30 iterations each) with Gamma = LeNet."""
    from coordinator.background import Deadline
    from coordinator.strategies.glfc import GlfcProxy

    manifest = manifest_of("lenet", 10, (1, 8, 8))
    out: dict[str, Any] = {}
    for device in devices:
        proxy = GlfcProxy(gamma="glfc_lenet", lbfgs_iterations=30, device=device, manifest=manifest)
        rng = np.random.default_rng(0)
        gradients = []
        for k in range(4):
            x = torch.from_numpy(rng.random((1, 1, 8, 8), dtype=np.float32)).to(proxy.device)
            logits, _ = proxy.gamma(x)
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor([k], device=proxy.device))
            grads = torch.autograd.grad(loss, list(proxy.gamma.parameters()))
            gradients.append(torch.cat([g.reshape(-1) for g in grads]).detach().cpu().numpy())
        out[device] = {"seconds": timed(lambda proxy=proxy, g=gradients: proxy.reconstruct(g, Deadline(600)), device)}
    return out


def aggregation_part(devices: list[str]) -> dict[str, Any]:
    """FedAvg over 50 ResNet-18-sized updates (11.2 M values), and the coordinate-wise median over 20."""
    from coordinator.strategies import ClientUpdate, make_strategy

    size = 11_173_962
    rng = np.random.default_rng(0)
    updates = [ClientUpdate(f"d{k}", rng.normal(0, 1, size).astype(np.float32), 10 + k) for k in range(50)]
    out: dict[str, Any] = {}
    results: dict[str, dict[str, np.ndarray]] = {}
    for device in devices:
        row = {}
        for rule, count in (("fedavg", 50), ("median", 20)):
            strategy = make_strategy(rule, device=device)
            start = torch.zeros(size, device=strategy.device)
            holder: dict[str, Any] = {}

            def run(strategy: Any = strategy, start: torch.Tensor = start, count: int = count,
                    holder: dict = holder) -> None:
                holder["w"] = strategy.aggregate(start, updates[:count]).global_weights

            row[rule] = timed(run, device)
            results.setdefault(device, {})[rule] = holder["w"].cpu().numpy()
        out[device] = row
    if "cuda" in results:
        out["max_abs_difference"] = {rule: float(np.abs(results["cuda"][rule] - results["cpu"][rule]).max())
                                     for rule in results["cpu"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="generator,glfc,aggregation")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    report: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "gpu": torch.cuda.get_device_name(0) if "cuda" in devices else None}
    parts = {"generator": generator_part, "glfc": glfc_part, "aggregation": aggregation_part}
    for name in args.parts.split(","):
        started = time.perf_counter()
        try:
            report[name] = parts[name](devices)
        except Exception as err:  # a part that cannot run here says why; the others still run
            report[name] = {"error": f"{type(err).__name__}: {err}"}
        report[name]["part_s"] = time.perf_counter() - started
        print(name, json.dumps(report[name], indent=1), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
