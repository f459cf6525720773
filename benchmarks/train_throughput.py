"""Local training throughput and footprint of the three trainer backends: portable (standard ONNX graphs on plain
onnxruntime), ORT Training, and torch eager; beside them a plain torch training loop and the physical reference.

Every backend trains the same model from the same weights on the same batches (SGD, same batch size), each in its
own process that imports only its backend, so that the process's peak RSS (VmHWM) is the backend's footprint while
training. `loop` is not edgefil's: the zoo's torch module trained by the loop anyone would write (shuffle, batches,
cross-entropy on the logits, zero_grad, backward, torch.optim.SGD step), with no class mask, no weight buffer and no
checks: what the device's training would cost written by hand in torch. Printed: samples/s per backend at each
thread count, the ratio of portable to the best of ORT Training, the torch trainer and the loop, and the physical
reference: the model's training FLOPs per sample (forward and backward, counted by torch's FlopCounterMode on a
batch) against the FLOP/s a 512x512 float32 matrix multiply reaches on the same cores and threads, as the samples/s
that ceiling allows and each backend's share of it. Where the portable backend is below the best, what stops it, per
model and thread count, from its step split measured in one more epoch (the fused plain step's session run, which a
plain step takes, the gradient and optimiser graphs' where a step is not plain, and the Python, binding and batching
around them) against the best's whole step: when the gradient alone takes longer, ORT's kernels for the standard-op
graphs; otherwise the session runs and the Python around them. Then the peak RSS, then each backend's install size (the
installed files of its packages and their dependencies; portable measured in a fresh CPython 3.12 virtual
environment with the device install's packages).

The portable backend runs where a device runs it (`--portable-python`): by default in a fresh virtual environment of
the device install (`pip install .` from this checkout: current onnxruntime), while ORT Training, torch and the loop
run in this environment; `here` runs it in this one too (on whatever onnxruntime build is installed here, the
training build in the test environment). The header names the onnxruntime each ran on.

    .venv/bin/python benchmarks/train_throughput.py [--batch 32] [--repeats 3] [--threads 1 2] [--no-install-size]
        [--portable-python device | here | PYTHON]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("portable", "ort", "torch")
LOOP = "loop"  # the plain torch loop
CASES = [  # model, input shape, samples per timed epoch (ResNet-18 trains ~100x slower per sample)
    ("lenet", (1, 8, 8), 4096),
    ("cnn1d", (1, 40), 4096),
    ("mlp", (1, 8, 8), 4096),
    ("small_cnn", (3, 32, 32), 1024),
    ("resnet18_cifar", (3, 32, 32), 64),
]


def peak_rss_mb() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def loop_worker(directory: str, threads: int, samples: int, batch: int, repeats: int) -> None:
    """In a fresh process: the plain torch loop on the artifacts' model and initial weights; samples/s, peak RSS."""
    import numpy as np
    import torch

    from models.manifest import WEIGHTS, load_manifest
    from models.zoo import build_for

    torch.set_num_threads(threads)
    manifest = load_manifest(Path(directory))
    net = build_for(manifest, seed=0)
    flat = torch.from_numpy(np.fromfile(Path(directory) / WEIGHTS, dtype="<f4").copy())
    torch.nn.utils.vector_to_parameters(flat, net.parameters())
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand((samples, *manifest.input_shape), generator=generator)
    y = torch.randint(0, manifest.num_classes, (samples,), generator=generator)

    def epoch(count: int) -> None:
        for index in torch.randperm(count, generator=generator).split(batch):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[index])[0], y[index]).backward()
            optimizer.step()

    epoch(batch * 2)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        epoch(samples)
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"rate": samples / best, "rss_mb": peak_rss_mb()}))


def reference_worker(directory: str, threads: int, batch: int) -> None:
    """In a fresh process: the model's training FLOPs per sample and a matrix multiply's FLOP/s at `threads`."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.manifest import load_manifest
    from models.zoo import build_for

    torch.set_num_threads(threads)
    manifest = load_manifest(Path(directory))
    net = build_for(manifest, seed=0)
    x = torch.rand((batch, *manifest.input_shape))
    y = torch.randint(0, manifest.num_classes, (batch,))
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.cross_entropy(net(x)[0], y).backward()
    a, b = torch.rand(512, 512), torch.rand(512, 512)
    for _ in range(3):
        a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        best = min(best, (time.perf_counter() - start) / 20)
    print(json.dumps({"flops_per_sample": counter.get_total_flops() / batch, "matmul_flops": 2 * 512**3 / best}))


def worker(backend: str, directory: str, threads: int, samples: int, batch: int, repeats: int) -> None:
    """In a fresh process: train with one backend, print samples/s and the peak RSS as JSON."""
    import numpy as np

    from edge_client.config import TrainerSettings
    from edge_client.trainers.choice import make_trainer

    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    trainer = make_trainer(TrainerSettings(backend=backend, optimizer="sgd", lr=0.01, threads=threads), directory)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *trainer.manifest.input_shape), dtype=np.float32)
    y = rng.integers(0, trainer.manifest.num_classes, samples)
    trainer.fit(x[: batch * 2], y[: batch * 2], epochs=1, batch_size=batch, rng=rng)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.fit(x, y, epochs=1, batch_size=batch, rng=rng)
        best = min(best, time.perf_counter() - start)
    result = {"rate": samples / best, "rss_mb": peak_rss_mb()}
    if backend in ("portable", "ort"):
        import onnxruntime

        result["runtime"] = onnxruntime.__version__
    if backend == "portable":
        result["split_us"] = portable_step_split(trainer, x, y, batch, rng)
    print(json.dumps(result))


def portable_step_split(trainer, x, y, batch: int, rng) -> dict[str, float]:
    """Where a portable step's time goes, in us a step over one more (untimed) epoch: the gradient graphs' session
    runs (the whole and the plain gradient), the update graphs' (the optimiser's whole and plain update), the fused
    plain step's (gradient and update in one run: models/manifest.py PLAIN_STEPS, what a plain step runs), and the
    rest (Python, binding, batching). Each session's `run_with_iobinding` is wrapped with a clock on the trainer's
    own session objects (`_session`, a benchmark's look inside)."""
    from models.manifest import PLAIN_GRADIENT, PLAIN_STEPS, PLAIN_UPDATES, PORTABLE_MODELS

    optimizer = trainer._optimizer_name
    kinds = {"gradient": "gradient", PLAIN_GRADIENT: "gradient", optimizer: "optimiser",
             PLAIN_UPDATES[optimizer]: "optimiser", PLAIN_STEPS[optimizer]: "fused"}
    spent = dict.fromkeys(("gradient", "optimiser", "fused"), 0.0)
    for graph, kind in kinds.items():
        if PORTABLE_MODELS[graph] not in trainer.manifest.files:
            continue
        session = trainer._session(graph)
        run = session.run_with_iobinding

        def timed(binding, *args, _run=run, _kind=kind, **kwargs):
            start = time.perf_counter()
            try:
                return _run(binding, *args, **kwargs)
            finally:
                spent[_kind] += time.perf_counter() - start

        session.run_with_iobinding = timed
    steps = -(-len(x) // batch)
    start = time.perf_counter()
    trainer.fit(x, y, epochs=1, batch_size=batch, rng=rng)
    whole = time.perf_counter() - start
    split = {kind: 1e6 * seconds / steps for kind, seconds in spent.items()}
    return {"step": 1e6 * whole / steps, **split, "rest": 1e6 * whole / steps - sum(split.values())}


def what_stops(split: dict[str, float], best_step_us: float, best: str) -> str:
    """The measured reason the portable step is slower than the best backend's (named `best`), in words."""
    numbers = (f"portable {split['step']:,.0f} us a step = fused step {split['fused']:,.0f} + gradient graph "
               f"{split['gradient']:,.0f} + optimiser graph {split['optimiser']:,.0f} + Python/binding/batching "
               f"{split['rest']:,.0f}; {best} {best_step_us:,.0f} us")
    if split["gradient"] + split["fused"] >= best_step_us:
        return f"the graphs' ORT kernels (the gradient alone slower than {best}'s whole step): {numbers}"
    return (f"the session runs and the Python around them (the gradient alone is faster than {best}'s whole "
            f"step): {numbers}")


def measure(backend: str, directory: Path, threads: int, samples: int, batch: int, repeats: int,
            python: str = sys.executable) -> dict:
    """One backend's run in a fresh process of `python`."""
    done = subprocess.run(
        [python, __file__, "--worker", backend, str(directory), str(threads), str(samples), str(batch),
         str(repeats)], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_python(folder: Path) -> str:
    """A fresh virtual environment in `folder` with the device install from this checkout (`pip install .`: its
    base dependencies, current onnxruntime among them); returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = str(folder / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(Path(__file__).resolve().parents[1])], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return python


def install_mb(python: str, roots: list[str]) -> float:
    """Installed size of the distributions `roots` and everything they require, in `python`'s environment."""
    script = """
import json, re, sys
from importlib import metadata
seen, todo, total = set(), list(sys.argv[1:]), 0
while todo:
    name = re.split(r"[ ;<>=!~\\[(]", todo.pop())[0].lower().replace("_", "-")
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    total += sum((dist.locate_file(f).stat().st_size for f in dist.files or [] if dist.locate_file(f).is_file()))
    todo += [r for r in dist.requires or [] if "extra ==" not in r]
print(json.dumps(total))
"""
    done = subprocess.run([python, "-c", script, *roots], capture_output=True, text=True, check=True)
    return int(done.stdout) / 1e6


def install_sizes() -> dict[str, float]:
    device = ["numpy", "msgpack", "paho-mqtt"]
    sizes = {"ort": install_mb(sys.executable, ["onnxruntime-training-cpu", *device]),
             "torch": install_mb(sys.executable, ["torch", *device])}
    pythons = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    if pythons:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([str(pythons[0]), "-m", "venv", tmp], check=True)
            subprocess.run([f"{tmp}/bin/python", "-m", "pip", "install", "--quiet", "onnxruntime", *device],
                           check=True)
            sizes["portable"] = install_mb(f"{tmp}/bin/python", ["onnxruntime", *device])
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=[c[0] for c in CASES])
    parser.add_argument("--no-install-size", action="store_true")
    parser.add_argument("--portable-python", default="device",
                        help="where the portable backend runs: device (a fresh device install), here, or an interpreter")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        backend, directory, threads, samples, batch, repeats = args.worker
        if backend == "reference":
            reference_worker(directory, int(threads), int(batch))
        else:
            run = loop_worker if backend == LOOP else functools.partial(worker, backend)
            run(directory, int(threads), int(samples), int(batch), int(repeats))
        return

    from models.export import export_registered

    print(f"batch {args.batch}, best of {args.repeats} epochs, SGD lr 0.01; each backend in its own process; "
          "best = the fastest of ort, torch and loop; ceiling = matmul FLOP/s / training FLOPs per sample")
    venvs = tempfile.TemporaryDirectory()
    pythons = dict.fromkeys(BACKENDS + (LOOP,), sys.executable)
    if args.portable_python == "device":
        pythons["portable"] = device_python(Path(venvs.name) / "device")
    elif args.portable_python != "here":
        pythons["portable"] = args.portable_python
    runtimes: dict[str, str] = {}
    timed = (*BACKENDS, LOOP)
    print(f"{'model':15s} {'params':>10s} {'MFLOP/smp':>9s} {'thr':>3s} " + " ".join(f"{b + ' s/s':>13s}" for b in timed)
          + f" {'portable/best':>13s} {'ceiling s/s':>11s} " + " ".join(f"{b + '/ceil':>9s}" for b in timed))
    rss: dict[tuple[str, str], float] = {}
    stops: list[str] = []  # per model and thread count where portable is below the best: what stops it
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape, samples in CASES:
            if name not in args.models:
                continue
            directory = Path(tmp) / name
            manifest = export_registered(name, 10, directory, input_shape=shape, seed=0, backends=BACKENDS)
            for threads in args.threads:
                result = {b: measure(b, directory, threads, samples, args.batch, args.repeats, pythons[b])
                          for b in timed}
                runtimes.update((b, r["runtime"]) for b, r in result.items() if "runtime" in r)
                reference = measure("reference", directory, threads, samples, args.batch, args.repeats)
                ceiling = reference["matmul_flops"] / reference["flops_per_sample"]
                rate = {b: r["rate"] for b, r in result.items()}
                for b, r in result.items():
                    rss[(name, b)] = max(rss.get((name, b), 0.0), r["rss_mb"])
                best = max(rate[b] for b in timed if b != "portable")
                print(f"{name:15s} {manifest.num_parameters:10,d} {reference['flops_per_sample'] / 1e6:9.2f} "
                      f"{threads:3d} " + " ".join(f"{rate[b]:13,.1f}" for b in timed)
                      + f" {rate['portable'] / best:13.2f} {ceiling:11,.0f} "
                      + " ".join(f"{rate[b] / ceiling:9.3f}" for b in timed))
                if rate["portable"] < best:
                    fastest = max((b for b in timed if b != "portable"), key=rate.__getitem__)
                    stops.append(f"{name} at {threads} thread{'s' if threads > 1 else ''}: " + what_stops(
                        result["portable"]["split_us"], 1e6 * args.batch / best, fastest))
            shutil.rmtree(directory)
    venvs.cleanup()
    print("\nonnxruntime: " + ", ".join(f"{b} on {version}" for b, version in sorted(runtimes.items())))
    if stops:
        print("\nwhat stops the portable backend where it is below the best (its step split, measured in one more "
              "epoch with each session run clocked; the best's step = batch / its samples/s)")
        for line in stops:
            print(f"- {line}")
    print("\npeak RSS of the training process (MB), the larger over thread counts")
    print(f"{'model':15s} " + " ".join(f"{b:>9s}" for b in (*BACKENDS, LOOP)))
    for name in dict.fromkeys(n for n, _ in rss):
        print(f"{name:15s} " + " ".join(f"{rss[(name, b)]:9.0f}" for b in (*BACKENDS, LOOP)))
    if not args.no_install_size:
        print("\ninstall size of each backend's device packages with numpy, msgpack, paho-mqtt (MB)")
        for backend, size in install_sizes().items():
            print(f"{backend:9s} {size:8.0f}")


if __name__ == "__main__":
    main()
