"""The emulation's building blocks: what a device's compute, network, availability and RAM allow. Pure, no I/O
beyond reading a trace file, no MQTT: a fleet runner combines them per device.

- Compute: a device keeps a `VirtualClock`; training advances it by the host's time scaled by how much slower the
  device is (`compute_seconds`). Speeds are single-thread float32 matmul throughput in GFLOPS, measured on the
  host once per run (`calibrate_host`) and stated for each device in its profile.
- Network: `transfer_seconds` from bytes, bandwidth and per-message latency.
- Availability: `AvailabilitySchedule` says when a device is online (always, seeded on/off, or a trace file).
- Memory: `training_peak_bytes` estimates a training step's peak RAM; `check_memory` fails as an OOM would.
- Modelled compute (`compute = "modelled"`, for runs that must give the same result on any host):
  `training_flops_per_sample` counts a model's training FLOPs, and `modelled_compute_seconds` turns the samples a
  round trains on into device time from them and the profile's speed alone, nothing measured.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from firmware_sim.profiles import Availability, DeviceProfile

# Resident memory of an idle device process, independent of the model: CPython 3.11 + numpy + the edge_client
# device modules + an ONNX Runtime 1.19.2 training session. Measured here (x86_64) as VmHWM from
# /proc/self/status of a fresh process that imported edge_client.device/learner/store and OrtTrainer, built a
# session on a 41,002-parameter MLP and took one AdamW step: 65,668 kB; less that model's weights, gradients and
# moments (0.66 MB) this leaves about 64 MiB. (The bare interpreter is 11 MB; the imports bring it to 48 MB.)
RUNTIME_OVERHEAD_BYTES = 64 * 2**20
FLOAT32_BYTES = 4
LABEL_BYTES = 8  # int64
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "adamw": 2}  # float32 values kept per parameter (AdamW: 2 moments)
CALIBRATION_SIZE = 512  # square float32 matrices: 3 MB, a sustained rather than an in-L1 figure


@dataclass(frozen=True)
class HostCalibration:
    """This host's single-thread float32 matmul throughput, in the unit of DeviceProfile.cpu_gflops."""

    gflops: float

    def __post_init__(self) -> None:
        if not 0 < self.gflops < math.inf:
            raise ValueError(f"host gflops must be positive and finite, got {self.gflops!r}")


def calibrate_host(seconds: float = 0.5) -> HostCalibration:
    """Measure the host once per run: best of repeated 512x512 float32 matmuls on one BLAS thread.

    The BLAS pool is limited with threadpoolctl (installed with the host extra, via scikit-learn), which works
    after numpy is imported, unlike OPENBLAS_NUM_THREADS. Best-of rather than mean: other processes only ever
    slow a repeat down.
    """
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((CALIBRATION_SIZE, CALIBRATION_SIZE), dtype=np.float32) for _ in range(2))
    out = np.empty_like(a)
    best = math.inf
    with threadpool_limits(limits=1):
        np.matmul(a, b, out=out)  # warm-up: first-call allocation and page faults
        deadline = time.perf_counter() + seconds
        while True:
            start = time.perf_counter()
            np.matmul(a, b, out=out)
            end = time.perf_counter()
            best = min(best, end - start)
            if end >= deadline:
                break
    return HostCalibration(gflops=2 * CALIBRATION_SIZE**3 / best / 1e9)


class VirtualClock:
    """A device's own time: advanced by emulated compute and network, never by the host's wall clock."""

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"clock start must be finite, got {start!r}")
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` and return the new time."""
        if not 0 <= seconds < math.inf:
            raise ValueError(f"a clock only moves forward by a finite amount, got {seconds!r}")
        self._now += seconds
        return self._now


def compute_seconds(
    host_seconds: float, profile: DeviceProfile, host: HostCalibration, threads: int = 1
) -> float:
    """Device time of work that took `host_seconds` on the host.

    Scaled by single-thread throughput, host.gflops / profile.cpu_gflops: the trainer runs the same number of
    intra-op threads (`threads`, default 1 as in the trainer settings) on host and device. A device with fewer
    cores than that runs the excess serially, a further threads / profile.threads. `host_seconds` should be the
    training thread's CPU time (time.thread_time) when several emulated devices share the host's cores, so that
    waiting for a core is not counted as compute.
    """
    if not 0 <= host_seconds < math.inf:
        raise ValueError(f"host_seconds must be finite and non-negative, got {host_seconds!r}")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    oversubscribed = max(1.0, threads / profile.threads)
    return host_seconds * host.gflops / profile.cpu_gflops * oversubscribed


# A training step's FLOPs per forward FLOP: the forward pass, and a backward pass of about twice it (the gradients of
# the inputs and of the weights, each about one forward's worth): the usual 3x of training-cost estimates.
TRAINING_PER_FORWARD = 3
COMPUTE_MODES = ("measured", "modelled")  # how an emulated device's compute time is had (firmware_sim/emulation.py)


def modelled_compute_seconds(samples: int, flops_per_sample: float, profile: DeviceProfile) -> float:
    """Device time of training on `samples` sample passes, modelled: their FLOPs (`training_flops_per_sample`) at
    the profile's `cpu_gflops`. Nothing is measured, so the same round takes the same device time on any host, at
    any load (what an asynchronous fleet's order of updates needs to be reproducible); what it leaves out (memory
    traffic, the framework's overhead per step) makes it a lower bound of the measured time's shape."""
    if samples < 0 or not 0 <= flops_per_sample < math.inf:
        raise ValueError(f"samples and flops_per_sample must be non-negative and finite, got {samples}, "
                         f"{flops_per_sample!r}")
    return samples * flops_per_sample / (profile.cpu_gflops * 1e9)


def training_flops_per_sample(model: str, num_classes: int, input_shape: tuple[int, ...],
                              model_args: Mapping[str, Any] | None = None) -> float:
    """One sample's training FLOPs on the zoo model: TRAINING_PER_FORWARD x its forward FLOPs, counted with forward
    hooks as 2 x the multiply-adds of its convolutions and linear layers (the rest, activations and pooling, is a
    few percent of those and left out)."""
    return TRAINING_PER_FORWARD * _forward_flops(model, num_classes, tuple(input_shape),
                                                 json.dumps(dict(model_args or {}), sort_keys=True))


@functools.cache
def _forward_flops(model: str, num_classes: int, input_shape: tuple[int, ...], args: str) -> float:
    import torch

    from models.zoo import build_model

    net = build_model(model, num_classes, input_shape, seed=0, args=json.loads(args))
    total = 0

    def count(module: torch.nn.Module, inputs: tuple, output: object) -> None:
        nonlocal total
        if isinstance(module, torch.nn.Linear):
            total += 2 * module.in_features * module.out_features
        elif isinstance(module, torch.nn.modules.conv._ConvNd) and isinstance(output, torch.Tensor):
            per_output = module.in_channels // module.groups * prod(module.kernel_size)
            total += 2 * output.numel() * per_output

    _one_sample_through(net, list(net.modules()), count, input_shape)
    return float(total)


def _one_sample_through(net: Any, modules: list[Any], hook: Any, input_shape: tuple[int, ...]) -> None:
    """One zero sample through `net`, `hook` a forward hook on each of `modules` while it goes."""
    import torch

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            net(torch.zeros(1, *input_shape))
    finally:
        for handle in handles:
            handle.remove()


def transfer_seconds(nbytes: int, mbps: float, latency_ms: float, messages: int = 1) -> float:
    """Time to move `nbytes` in `messages` messages: one latency per message plus the bytes at the bandwidth."""
    if nbytes < 0 or messages < 0:
        raise ValueError(f"bytes and messages must be non-negative, got {nbytes} and {messages}")
    if not 0 < mbps < math.inf or not 0 <= latency_ms < math.inf:
        raise ValueError(f"need a positive bandwidth and a non-negative latency, got {mbps} and {latency_ms}")
    return messages * latency_ms / 1e3 + nbytes * 8 / (mbps * 1e6)


class RealTimePacer:
    """Real-time mode: sleeps so that host wall time keeps up with a virtual clock (never sleeps negative).

    Wall time and virtual time are both counted from the pacer's creation; `speedup` > 1 runs faster than real.
    """

    def __init__(self, clock: VirtualClock, speedup: float = 1.0) -> None:
        if not 0 < speedup < math.inf:
            raise ValueError(f"speedup must be positive and finite, got {speedup!r}")
        self._clock = clock
        self._speedup = speedup
        self._virtual_origin = clock.now()
        self._wall_origin = time.monotonic()

    def wait(self) -> float:
        """Sleep until the wall time since creation reaches the virtual time since creation / speedup; return
        the seconds slept (0 when the host is already behind)."""
        due = self._wall_origin + (self._clock.now() - self._virtual_origin) / self._speedup
        start = time.monotonic()
        if due <= start:
            return 0.0
        time.sleep(due - start)
        return time.monotonic() - start


class AvailabilitySchedule:
    """When one device is online, from t = 0 of the run. The schedule is a sorted list of the times at which
    `online` flips; on/off schedules are drawn lazily, in fixed-size batches, so the same seed gives the same
    schedule whatever was asked first.

    "always": online for good. "on-off": online at 0, then alternating exponential on and off durations.
    "trace": the file's intervals, online on [start, end), offline elsewhere. With `horizon_s`, nothing changes
    at or after the horizon: the state there is kept for good.
    """

    _BATCH = 64  # on/off pairs drawn at a time

    def __init__(self, availability: Availability, seed: int, horizon_s: float | None = None) -> None:
        if horizon_s is not None and not horizon_s > 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        self._availability = availability
        self._horizon = math.inf if horizon_s is None else horizon_s
        self._rng = np.random.default_rng(seed)
        self._changes: list[float] = []
        self._initially_online = availability.mode != "trace"
        self._exhausted = availability.mode != "on-off"  # True once no further change can be drawn
        if availability.mode == "trace":
            assert availability.trace is not None  # Availability guarantees it
            flips = [t for interval in read_trace(availability.trace) for t in interval]
            self._changes = [t for t in flips if t < self._horizon]

    def online(self, t: float) -> bool:
        self._draw_past(t)
        flips = bisect.bisect_right(self._changes, t)
        return self._initially_online != (flips % 2 == 1)

    def next_change(self, t: float) -> float | None:
        """When `online` next flips after `t` (None: never)."""
        self._draw_past(t)
        index = bisect.bisect_right(self._changes, t)
        return self._changes[index] if index < len(self._changes) else None

    def intervals(self, until: float) -> list[tuple[float, float]]:
        """Online intervals [start, end) within [0, until]."""
        if not until > 0:
            return []
        self._draw_past(until)
        starts_online = self.online(0.0)
        edges = [0.0] if starts_online else []
        edges += [t for t in self._changes if 0 < t < until]
        if len(edges) % 2:
            edges.append(until)
        return list(zip(edges[::2], edges[1::2]))

    def _draw_past(self, t: float) -> None:
        """Draw on/off durations until a change lies beyond `t` or the horizon is reached."""
        if not math.isfinite(t):
            raise ValueError(f"times must be finite, got {t!r}")
        means = (float(self._availability.mean_on_s or 0.0), float(self._availability.mean_off_s or 0.0))
        while not self._exhausted and (not self._changes or self._changes[-1] <= t):
            durations = self._rng.exponential(means, size=(self._BATCH, 2)).ravel()
            last = self._changes[-1] if self._changes else 0.0
            for change in (last + np.cumsum(durations)).tolist():
                if change >= self._horizon:
                    self._exhausted = True
                    break
                self._changes.append(change)


def read_trace(path: str | Path) -> list[tuple[float, float]]:
    """Online intervals from a trace file: `start_s,end_s` per line, sorted, not overlapping, end_s may be
    `inf`; blank lines and text after '#' are ignored. Touching intervals are merged. Errors name the line."""
    intervals: list[tuple[float, float]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            where = f"{path}:{number}"
            fields = text.split(",")
            try:
                start, end = (float(field) for field in fields)
            except ValueError:
                raise ValueError(f"{where}: expected 'start_s,end_s', got {text!r}") from None
            if not 0 <= start < math.inf or math.isnan(end):
                raise ValueError(f"{where}: start must be finite and non-negative, end a number, got {text!r}")
            if end <= start:
                raise ValueError(f"{where}: interval ends at {end} before it starts at {start}")
            if intervals and start < intervals[-1][0]:
                raise ValueError(f"{where}: intervals are not sorted ({start} after {intervals[-1][0]})")
            if intervals and start < intervals[-1][1]:
                raise ValueError(f"{where}: interval starting at {start} overlaps the one ending at {intervals[-1][1]}")
            if intervals and start == intervals[-1][1]:
                intervals[-1] = (intervals[-1][0], end)
            else:
                intervals.append((start, end))
    return intervals


class DeviceOutOfMemory(MemoryError):
    """A training job needs more RAM than the device has: the emulated process dies as an OOM kill would."""

    def __init__(self, device: str, needed: int, available: int) -> None:
        super().__init__(f"{device}: training needs {needed:,} bytes of RAM, the device has {available:,}")
        self.device = device
        self.needed = needed
        self.available = available


def training_peak_bytes(
    model: str,
    num_classes: int,
    input_shape: tuple[int, ...],
    batch_size: int,
    optimizer: str,
    num_parameters: int | None = None,
    model_args: Mapping[str, Any] | None = None,
) -> int:
    """Peak RAM of one training step, estimated: float32 weights and gradients, the optimizer's state
    (sgd: none, adamw: two moments), every module's output for the batch twice (the activation and its gradient),
    the input batch with labels and class mask, and RUNTIME_OVERHEAD_BYTES.

    `num_parameters` is the manifest's total where known; it defaults to the model's count (`model_args`: a
    user's model's constructor arguments, models/zoo.py).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    args = json.dumps(dict(model_args or {}), sort_keys=True)  # hashable, for the cache of footprints
    counted, activations_per_sample = _model_footprint(model, num_classes, tuple(input_shape), args)
    parameters = counted if num_parameters is None else num_parameters
    parameter_bytes = FLOAT32_BYTES * parameters * (2 + OPTIMIZER_STATES[optimizer])
    sample_bytes = 2 * activations_per_sample + FLOAT32_BYTES * prod(input_shape) + LABEL_BYTES
    return RUNTIME_OVERHEAD_BYTES + parameter_bytes + batch_size * sample_bytes + FLOAT32_BYTES * num_classes


@functools.cache
def _model_footprint(model: str, num_classes: int, input_shape: tuple[int, ...], args: str) -> tuple[int, int]:
    """(parameter count, bytes of all module outputs for one sample), measured with forward hooks on the zoo
    model. Outputs of leaf modules only (a container's output is its last child's); an in-place output that
    aliases its input (ReLU(inplace=True)) is not counted again. Activations grow linearly with the batch."""
    import torch

    from models.zoo import build_model

    net = build_model(model, num_classes, input_shape, seed=0, args=json.loads(args))
    total = 0

    def count(module: torch.nn.Module, inputs: tuple, output: object) -> None:
        nonlocal total
        seen = {t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                total += tensor.numel() * tensor.element_size()

    _one_sample_through(net, [m for m in net.modules() if not list(m.children())], count, input_shape)
    return sum(p.numel() for p in net.parameters()), total


def check_memory(profile: DeviceProfile, peak_bytes: int) -> None:
    """Raise DeviceOutOfMemory when a job's peak exceeds the RAM the profile leaves to the training process."""
    if peak_bytes > profile.ram_bytes:
        raise DeviceOutOfMemory(profile.name, peak_bytes, profile.ram_bytes)
