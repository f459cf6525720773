"""Where a fleet's CPU goes below Python: `perf record -a` over a stretch of a run, read back per process (the
coordinator, the brokers, the device workers), per library, and in the kernel per system call and per function.

yappi and py-spy see a process's Python; they do not see the time its threads spend in the kernel (a worker's was a
third of its CPU) or in C libraries (SQLite, ONNX Runtime, glibc's allocator). perf samples every CPU of the host
at `FREQUENCY_HZ` with call chains, whatever runs; each sample is counted once, by the process it interrupted
(`roles`: pid -> role; processes not named there are "other", the idle task "idle") and by its innermost frame's
library. A kernel sample is put to the system call that its call chain passes through (none: a page fault, an
interrupt, the scheduler's return). Percentages are of the host's busy samples, so the sides add up.

Needs `perf` (Debian: linux-perf) and the right to record the whole host (root, or kernel.perf_event_paranoid <= -1);
`HostProfile.available()` says why not, in one line.
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
from pathlib import Path

FREQUENCY_HZ = 199  # samples a second per CPU: prime, so it does not beat with the fleet's own periodic work


class HostProfile:
    """`start()` records the whole host into `folder`/perf.data until `stop()`; `print_tables` reads it back."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str | None:
        """None where a whole-host recording can be made here, else why not."""
        if shutil.which("perf") is None:
            return "perf is not installed (Debian: apt-get install linux-perf)"
        paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
        if os.geteuid() != 0 and paranoid.exists() and int(paranoid.read_text()) > -1:
            return "recording the whole host needs root or kernel.perf_event_paranoid = -1"
        return None

    @property
    def running(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            ["perf", "record", "-a", "-g", "-F", str(FREQUENCY_HZ), "-o", str(self.folder / "perf.data")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)  # perf writes its file out and ends
        self._process.wait(120)
        self._process = None

    def print_tables(self, roles: dict[int, str], top: int) -> None:
        samples = self._samples(roles)
        busy = [s for s in samples if s[0] != "idle"]
        if not busy:
            print("host profile: no samples")
            return
        share = 100.0 / len(busy)
        print(f"\nhost profile (perf, {FREQUENCY_HZ} Hz a CPU): {len(busy)} busy samples, "
              f"{len(busy) / len(samples) * 100:.0f} % of the host's; % of the busy ones")
        tables = (("by process", lambda s: s[0]), ("by process and thread", lambda s: f"{s[0]:<12} {s[4]}"),
                  ("by process and library", lambda s: f"{s[0]:<12} {s[1]}"),
                  ("in the kernel, by process and system call", lambda s: s[2] and f"{s[0]:<12} {s[2]}"),
                  ("in the kernel, by process and function", lambda s: s[3] and f"{s[0]:<12} {s[3]}"))
        for title, key in tables:
            counts = collections.Counter(k for k in map(key, busy) if k)
            print(f"{title}:")
            for name, count in counts.most_common(top):
                print(f"  {count * share:5.1f} %  {name}")

    def _samples(self, roles: dict[int, str]) -> list[tuple[str, str, str, str, str]]:
        """(role, library, system call or "", kernel function or "", thread) of each sample: the thread by its name
        in the system (edgefil/thread_names.py: a fleet worker's "device", "device-turns", its network loop's; an
        unnamed one by its process's)."""
        script = subprocess.run(["perf", "script", "-i", str(self.folder / "perf.data"), "-F", "comm,pid,ip,sym,dso"],
                                capture_output=True, text=True, check=True).stdout
        out = []
        for block in script.split("\n\n"):
            lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
            if len(lines) < 2:
                continue
            thread, pid_text = lines[0].rsplit(None, 1)  # a name may hold spaces; the pid is the line's last word
            pid = int(pid_text)
            role = "idle" if pid == 0 else roles.get(pid, "other")
            frames = [line.split(None, 1)[1] if " " in line else line for line in lines[1:]]
            library = frames[0].rsplit("(", 1)[-1].rstrip(")").rsplit("/", 1)[-1]
            call = kernel = ""
            if library == "[kernel.kallsyms]":
                library, kernel = "kernel", _symbol(frames[0])
                calls = [_symbol(f) for f in frames if _symbol(f).startswith("__x64_sys_")]
                call = calls[0].removeprefix("__x64_sys_") if calls else "(no system call)"
            out.append((role, library, call, kernel, thread.strip()))
        return out


def _symbol(frame: str) -> str:
    return frame.split(" (", 1)[0].split("+", 1)[0]
