"""How long the command line takes to refuse a config file with a typo, against its own start-up, in one run.

For each file kind (device, coordinator, fleet) a file with one misspelt key is given to `edgefil client`,
`edgefil coordinator` and `edgefil fleet run`; each must exit 2 with one line and start nothing. The baseline is
`edgefil --version`: a Python process that imports the command line and exits. The ratio says what checking a
file adds to starting the process (the fleet and coordinator commands import torch, which dominates).

    .venv/bin/python benchmarks/config_refusal.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import best_time  # benchmarks/timing.py: scripts run from their folder

TYPOS = {  # kind: (command, a file with a misspelt key)
    "device": (["client", "--config"], 'device_id = "d"\nfleet = "f"\nartifacts = "a"\nstate_dir = "s"\n'
                                       '[store]\nmax_sample = 10\n[data]\nfolder = "x"\n'),
    "coordinator": (["coordinator", "--config"], 'fleet = "f"\nout = "o"\nartifacts = "a"\ndevics = ["d"]\n'),
    "fleet": (["fleet", "run"], 'name = "lab"\ndevices = 4\nscenario = {preset = "digits-class"}\n'
                                '[policy]\nname = "reffed"\n'),
}


def run_cli(args: list[str], cwd: Path, expect: int) -> None:
    done = subprocess.run([sys.executable, "-m", "edgefil.cli", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != expect:
        raise SystemExit(f"edgefil {' '.join(args)} exited {done.returncode}: {done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        baseline = best_time(lambda _: run_cli(["--version"], folder, 0), args.repeats)
        print(f"baseline: edgefil --version {baseline:.2f} s (best of {args.repeats})")
        print(f"{'file kind':12s} {'refused in s':>12s} {'/ baseline':>10s}")
        for kind, (command, text) in TYPOS.items():
            path = folder / f"{kind}.toml"
            path.write_text(text)
            seconds = best_time(lambda _: run_cli([*command, str(path)], folder, 2), args.repeats)
            print(f"{kind:12s} {seconds:12.2f} {seconds / baseline:10.2f}")


if __name__ == "__main__":
    main()
