"""Generator replay (pFedGRP) against raw-sample replay and no replay on the embedded flowing-data scenarios, at
the same storage budget in bytes. Every run is a real fleet: coordinator, 10 device daemons, mosquitto (or the
embedded broker), all through MQTT.

    generator   per-class conv VAEs in the store's budget + pFedGRP's personalized aggregation
    gen-mlp     the same with MLP VAEs
    refed       Re-Fed importance caching of raw samples, FedAvg
    random      a random cache of raw samples, FedAvg
    none        no replay (current task only), FedAvg

Prints AA and AFM (pFedGRP's Eqs. 10-11, %, mean ± std over seeds), the peak bytes each method stored per device
(store + generators, mean over devices and seeds) against the budget, and for the generator methods the share of
their replay samples pFedGRP's quality check kept.

    .venv/bin/python benchmarks/flowing_replay.py [--seeds 0,1,2] [--sequences circulating,gradual]
        [--datasets digits,mnist1d] [--methods generator,refed,random,none] [--out runs/flowing-replay]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.config import StoreSettings, TrainerSettings
from firmware_sim.fleet import Fleet
from firmware_sim.fleet_config import FleetConfig

# scenario preset prefix, model, budget M in bytes per device, local epochs. M: the generator method's bank (at most
# half of M) holds ten int8 VAE generators, and the other half one round's real data with the store's overhead.
DATASETS: dict[str, tuple[str, str, int, int]] = {
    "digits": ("digits-flowing", "lenet", 320 * 1024, 3),
    "mnist1d": ("mnist1d-flowing", "cnn1d", 352 * 1024, 3),
}
# The generator methods run the policy's defaults (the paper's 1000 / 100 steps, the encoder kept for warm starts)
# and pFedGRP's server quality check; only the kind differs.
METHODS: dict[str, dict[str, Any]] = {
    "generator": {"policy": {"name": "generator", "kind": "conv-vae", "precision": "int8"},
                  "strategy": {"name": "pfedgrp"}},
    "gen-mlp": {"policy": {"name": "generator", "kind": "vae", "precision": "int8"}, "strategy": {"name": "pfedgrp"}},
    "refed": {"policy": {"name": "refed", "pim_epochs": 2}, "strategy": {"name": "fedavg"}},
    "random": {"policy": {"name": "random"}, "strategy": {"name": "fedavg"}},
    "none": {"policy": {"name": "none"}, "strategy": {"name": "fedavg"}},
}


def run_one(out: Path, dataset: str, sequence: str, method: str, seed: int, devices: int) -> dict[str, Any]:
    preset, model, budget, epochs = DATASETS[dataset]
    options = METHODS[method]
    config = FleetConfig(
        name=f"flow-{method}", out=out, devices=devices, workers=2, model=model, seed=seed, broker="auto",
        scenario={"preset": f"{preset}-{sequence}", "seed": seed},
        policy=options["policy"], store=StoreSettings(max_bytes=budget),
        trainer=TrainerSettings(backend="torch", optimizer="adamw", lr=3e-3),  # one backend for all methods
        client={"epochs": epochs}, strategy=options["strategy"],
        coordinator={"rounds_per_task": 1, "min_clients": devices, "deadline_s": 300.0, "wait_for_devices_s": 120.0},
    )
    results_file = out / "results.json"
    if results_file.exists():  # a finished run is read back, not repeated
        return json.loads(results_file.read_text())
    return Fleet(config).run()


def peak_stored_bytes(results: dict[str, Any]) -> float:
    """Mean over devices of each device's largest reported stored bytes (store + generators)."""
    peaks: dict[str, float] = {}
    for entry in results["history"]:
        for device, metrics in entry.get("metrics", {}).items():
            peaks[device] = max(peaks.get(device, 0.0), float(metrics.get("stored_bytes", 0.0)))
    return float(np.mean(list(peaks.values()))) if peaks else 0.0


def recognised_share(results: dict[str, Any]) -> float | None:
    """Mean over rounds and devices of the share of generated replay samples pFedGRP's quality check kept (the
    reference model recognised them); None for a run without the check."""
    shares = [m["recognised"] for entry in results["history"] for m in entry.get("rule_metrics", {}).values()
              if "recognised" in m]
    return float(np.mean(shares)) if shares else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--sequences", default="circulating,gradual")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--out", default="runs/flowing-replay")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for dataset in args.datasets.split(","):
        for sequence in args.sequences.split(","):
            for method in args.methods.split(","):
                runs = []
                for seed in seeds:
                    started = time.perf_counter()
                    out = Path(args.out) / f"{dataset}-{sequence}" / method / f"seed{seed}"
                    results = run_one(out, dataset, sequence, method, seed, args.devices)
                    recognised = recognised_share(results)
                    runs.append((results["aa"], results["afm"], peak_stored_bytes(results),
                                 np.nan if recognised is None else recognised))
                    print(f"{dataset}-{sequence} {method} seed {seed}: AA {results['aa']:.2%} AFM {results['afm']:.2%} "
                          f"stored {runs[-1][2] / 1024:.0f} KiB"
                          + ("" if recognised is None else f", replay samples recognised {recognised:.1%}")
                          + f" ({time.perf_counter() - started:.0f} s)", flush=True)
                rows.append((f"{dataset}-{sequence}", method, np.array(runs)))
    print(f"\n{args.devices} devices, 20 rounds (one new task per round), seeds {seeds}; AA/AFM in %, mean ± std; "
          f"stored = peak bytes per device (store + generators), mean; recognised = the share of generated replay "
          f"samples pFedGRP's quality check kept, %")
    print(f"{'scenario':22s} {'method':10s} {'budget':>8s} {'AA':>15s} {'AFM':>13s} {'stored':>10s} {'recognised':>10s}")
    for scenario, method, values in rows:
        budget = DATASETS[scenario.split("-")[0]][2]
        aa, afm, recognised = values[:, 0] * 100, values[:, 1] * 100, values[:, 3] * 100
        print(f"{scenario:22s} {method:10s} {budget // 1024:6d}Ki {aa.mean():7.2f} ± {aa.std():5.2f} "
              f"{afm.mean():5.2f} ± {afm.std():5.2f} {values[:, 2].mean() / 1024:8.1f}Ki "
              + (f"{np.mean(recognised):10.1f}" if np.isfinite(recognised).all() else f"{'—':>10s}"))


if __name__ == "__main__":
    main()
