"""How big the device install is: a fresh virtual environment with `pip install .` from this checkout (the base
dependencies only: numpy, msgpack, paho-mqtt, google-crc32c, blake3, cryptography and current onnxruntime), against the host
install (.venv, with the host, dev, ray and ort-training extras) measured in the same run.

    .venv/bin/python benchmarks/device_install.py [--python python3.12 ...]

Prints each install's size on disk and what is biggest in it; nothing is downloaded that pip would not fetch for a
real device (pip's cache is used, as it would be on a device that installed before)."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def biggest(venv: Path, n: int = 5) -> list[tuple[str, int]]:
    site = next(venv.glob("lib/python*/site-packages"))
    parts = [(p.name, size(p)) for p in site.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", "__pycache__"))]
    return sorted(parts, key=lambda kv: -kv[1])[:n]


def device_install(python: str, folder: Path) -> Path:
    venv = folder / f"venv-{Path(python).name}"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", str(ROOT)], check=True)
    return venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", nargs="+", default=[sys.executable],
                        help="interpreters to make device installs with (default: this one)")
    args = parser.parse_args()
    host = ROOT / ".venv"
    host_size = size(host) if host.is_dir() else None
    print("| install | Python | size | vs the host install | biggest parts |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for python in args.python:
            found = shutil.which(python) or python
            venv = device_install(found, Path(tmp))
            version = subprocess.run([str(venv / "bin/python"), "-c", "import sys; print(sys.version.split()[0])"],
                                     capture_output=True, text=True).stdout.strip()
            measured = size(venv)
            ratio = f"{measured / host_size:.2f}x" if host_size else "—"
            parts = ", ".join(f"{name} {s / 2**20:.0f} MiB" for name, s in biggest(venv))
            print(f"| device (`pip install .`) | {version} | {measured / 2**20:.0f} MiB | {ratio} | {parts} |")
    if host_size:
        parts = ", ".join(f"{name} {s / 2**20:.0f} MiB" for name, s in biggest(host))
        print(f"| host (`.[host,dev,ray,ort-training]`, .venv) | {sys.version.split()[0]} | {host_size / 2**20:.0f} MiB | 1.00x | "
              f"{parts} |")


if __name__ == "__main__":
    main()
