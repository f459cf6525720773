"""A virtual device's environment: its profile's RAM, compute speed and link applied to each round, on a virtual
clock (`edge_client.environment.Environment`).

Availability follows the profile's schedule, sped up by `time_scale` (profile seconds per second of the clock it
follows), so hour-long on/off periods show within a short run. On the fleet's clock (`availability_clock =
"fleet"`, a simulated fleet in virtual time): the coordinator names each round's start on it (`clock_s`), the device
is online or away for the round by the schedule at that moment, and it never disconnects (an away device answers
the round "away"), so who takes part does not depend on how fast the host runs the fleet. On the wall clock
("wall", real time): the schedule runs from when the device joined, and an offline device disconnects.

Compute is measured (`compute = "measured"`: the training thread's CPU time, scaled by the host's and the
profile's speeds) or modelled (`"modelled"`: the round's sample passes times the model's training FLOPs, at the
profile's speed: nothing measured, so the same run gives the same device times on any host, which an asynchronous
fleet's order of updates needs to be reproducible: limits.modelled_compute_seconds).

Virtual time (default): nothing sleeps; the device reports the round's device seconds (download + compute +
upload) with its update and a coordinator in virtual-time mode drops updates whose device time exceeds the round's
deadline, as a real slow device would miss it. Real-time mode also sleeps the difference, so wall-clock deadlines
apply unchanged (slower: a run takes as long as on the devices).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from edge_client.environment import TakesTurns, Turns
from firmware_sim.limits import (
    COMPUTE_MODES,
    AvailabilitySchedule,
    HostCalibration,
    VirtualClock,
    check_memory,
    compute_seconds,
    modelled_compute_seconds,
    training_flops_per_sample,
    training_peak_bytes,
    transfer_seconds,
)
from firmware_sim.profiles import DeviceProfile
from models.manifest import Manifest

AVAILABILITY_CLOCKS = ("wall", "fleet")


class EmulatedEnvironment(TakesTurns):
    def __init__(
        self, profile: DeviceProfile, host: HostCalibration, real_time: bool = False, availability_seed: int = 0,
        time_scale: float = 1.0, turns: Turns | None = None,
        clock: Callable[[], float] = time.monotonic, availability_clock: str = "wall", compute: str = "measured",
    ) -> None:
        """`turns`: shared by the devices of one worker process, which take turns at CPU work (None: alone);
        `clock`: the wall clock (seconds) availability follows, which a test may step itself; `availability_clock`:
        which clock availability follows (AVAILABILITY_CLOCKS, the module docstring); `compute`: measured or
        modelled (COMPUTE_MODES, the module docstring)."""
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        if availability_clock not in AVAILABILITY_CLOCKS:
            raise ValueError(f"availability_clock must be one of {AVAILABILITY_CLOCKS}, got {availability_clock!r}")
        if compute not in COMPUTE_MODES:
            raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
        self.on_fleet_clock = availability_clock == "fleet"
        self.modelled = compute == "modelled"
        self._flops_per_sample = 0.0  # modelled compute: the model's, known once training is checked
        self.profile = profile
        self.host = host
        self.real_time = real_time
        self.clock = VirtualClock()
        self.schedule = AvailabilitySchedule(profile.availability, availability_seed)
        self.time_scale = time_scale  # availability: profile seconds per wall second since the device joined
        self._clock = clock
        self._joined = clock()
        super().__init__(turns)

    def check_training(self, manifest: Manifest, batch_size: int, optimizer: str) -> None:
        peak = training_peak_bytes(
            manifest.model, manifest.num_classes, tuple(manifest.input_shape), batch_size, optimizer,
            manifest.num_parameters, manifest.model_args,
        )
        check_memory(self.profile, peak)
        if self.modelled:
            self._flops_per_sample = training_flops_per_sample(
                manifest.model, manifest.num_classes, tuple(manifest.input_shape), manifest.model_args)

    def compute(self, host_seconds: float, samples: int = 0) -> float:
        if self.modelled:
            seconds = modelled_compute_seconds(samples, self._flops_per_sample, self.profile)
        else:
            seconds = compute_seconds(host_seconds, self.profile, self.host)
        self._spend(seconds, already=host_seconds)
        return seconds

    def transfer(self, nbytes: int, messages: int, upload: bool) -> float:
        mbps = self.profile.up_mbps if upload else self.profile.down_mbps
        seconds = transfer_seconds(nbytes, mbps, self.profile.latency_ms, messages)
        self._spend(seconds, already=0.0)
        return seconds

    def offline_for(self) -> float:
        if self.on_fleet_clock:
            return 0.0
        t = (self._clock() - self._joined) * self.time_scale
        if self.schedule.online(t):
            return 0.0
        back = self.schedule.next_change(t)
        return math.inf if back is None else (back - t) / self.time_scale

    def online_for(self) -> float:
        if self.on_fleet_clock:
            return math.inf
        t = (self._clock() - self._joined) * self.time_scale
        if not self.schedule.online(t):
            return 0.0
        change = self.schedule.next_change(t)
        return math.inf if change is None else (change - t) / self.time_scale

    def away_at(self, clock_s: float | None) -> bool:
        if not self.on_fleet_clock or clock_s is None:
            return False
        return not self.schedule.online(clock_s * self.time_scale)

    def _spend(self, seconds: float, already: float) -> None:
        self.clock.advance(seconds)
        if self.real_time and seconds > already:
            time.sleep(seconds - already)
