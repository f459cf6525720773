"""Emulation building blocks: host calibration, virtual time, transfers, availability, memory."""
from __future__ import annotations

import dataclasses
import math
import time
from importlib.resources import files
from pathlib import Path

import pytest

from firmware_sim.limits import (
    AvailabilitySchedule,
    DeviceOutOfMemory,
    HostCalibration,
    RealTimePacer,
    VirtualClock,
    calibrate_host,
    check_memory,
    compute_seconds,
    read_trace,
    training_peak_bytes,
    transfer_seconds,
)
from firmware_sim.profiles import Availability, load_profile

HOST = HostCalibration(gflops=40.0)


def profile_with(**changes):
    return dataclasses.replace(load_profile("generic"), **changes)


def trace_schedule(tmp_path: Path, text: str, **kwargs) -> AvailabilitySchedule:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return AvailabilitySchedule(Availability("trace", trace=str(path)), seed=0, **kwargs)


# --- compute ---------------------------------------------------------------------------------------


def test_calibration_is_positive_and_repeatable_within_a_broad_factor():
    # A quarter second each, not less: best-of needs one repeat that other processes left alone, and on a
    # shared two-core host a 0.05 s window once held none (2.9 against 21 GFLOPS in one suite run).
    first, second = calibrate_host(0.25), calibrate_host(0.25)
    assert first.gflops > 0 and second.gflops > 0
    assert 1 / 3 < first.gflops / second.gflops < 3


def test_a_calibration_must_be_positive():
    with pytest.raises(ValueError):
        HostCalibration(0.0)


def test_a_device_half_as_fast_as_the_host_takes_twice_as_long():
    half = profile_with(cpu_gflops=HOST.gflops / 2)
    same = profile_with(cpu_gflops=HOST.gflops)
    quarter = profile_with(cpu_gflops=HOST.gflops / 4)
    assert compute_seconds(1.5, half, HOST) == pytest.approx(3.0)
    assert compute_seconds(1.5, same, HOST) == pytest.approx(1.5)
    assert compute_seconds(1.5, quarter, HOST) == pytest.approx(6.0)
    assert compute_seconds(0.0, half, HOST) == 0.0


def test_threads_beyond_the_device_cores_run_serially():
    two_cores = profile_with(cpu_gflops=HOST.gflops, threads=2)
    assert compute_seconds(1.0, two_cores, HOST, threads=2) == pytest.approx(1.0)
    assert compute_seconds(1.0, two_cores, HOST, threads=4) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        compute_seconds(-1.0, two_cores, HOST)


# --- network ---------------------------------------------------------------------------------------


def test_transfer_time_is_latency_per_message_plus_bytes_over_bandwidth():
    # 1 MB at 8 Mb/s is one second; two messages at 50 ms each add 0.1 s.
    assert transfer_seconds(1_000_000, 8.0, 50.0, messages=2) == pytest.approx(1.1)
    assert transfer_seconds(0, 100.0, 3.0) == pytest.approx(0.003)
    assert transfer_seconds(125_000, 1.0, 0.0) == pytest.approx(1.0)
    for bad in ((-1, 1.0, 0.0), (1, 0.0, 0.0), (1, 1.0, -1.0)):
        with pytest.raises(ValueError):
            transfer_seconds(*bad)


# --- virtual time ----------------------------------------------------------------------------------


def test_the_virtual_clock_moves_only_forward_and_only_when_told():
    clock = VirtualClock(start=10.0)
    assert clock.now() == 10.0
    time.sleep(0.01)
    assert clock.now() == 10.0  # the host's wall clock does not move it
    assert clock.advance(2.5) == 12.5
    assert clock.advance(0.0) == 12.5
    with pytest.raises(ValueError):
        clock.advance(-0.1)
    with pytest.raises(ValueError):
        clock.advance(math.nan)
    assert clock.now() == 12.5


def test_the_pacer_sleeps_the_gap_and_never_negative():
    """Lower bounds only: how much longer than the gap a busy host sleeps is the host's, not the pacer's."""
    clock = VirtualClock(start=100.0)  # virtual time counts from the pacer's creation, not from zero
    created = time.monotonic()
    pacer = RealTimePacer(clock)
    assert pacer.wait() == 0.0
    clock.advance(0.15)
    assert pacer.wait() >= 0.0
    assert time.monotonic() - created >= 0.15  # the wall time has caught up with the virtual time
    assert pacer.wait() == 0.0  # caught up: nothing left to sleep

    created = time.monotonic()
    fast = RealTimePacer(clock, speedup=10.0)
    clock.advance(1.0)  # 1 virtual second is 0.1 s of wall time at speedup 10
    assert fast.wait() >= 0.0 and time.monotonic() - created >= 0.1
    time.sleep(0.12)
    clock.advance(1.0)  # 0.1 s more is due and 0.12 s have passed: nothing to sleep (at speedup 1, 0.88 s)
    assert fast.wait() == 0.0


def test_a_pacer_behind_the_host_does_not_sleep():
    clock = VirtualClock()
    pacer = RealTimePacer(clock)
    time.sleep(0.05)
    clock.advance(0.01)
    assert pacer.wait() == 0.0


# --- availability ----------------------------------------------------------------------------------


def test_always_on_never_changes():
    schedule = AvailabilitySchedule(Availability("always"), seed=0)
    assert all(schedule.online(t) for t in (0.0, 1.0, 1e9))
    assert schedule.next_change(0.0) is None
    assert schedule.intervals(100.0) == [(0.0, 100.0)]


def test_on_off_is_seeded():
    availability = Availability("on-off", mean_on_s=30.0, mean_off_s=10.0)
    one = AvailabilitySchedule(availability, seed=1).intervals(5000.0)
    again = AvailabilitySchedule(availability, seed=1).intervals(5000.0)
    other = AvailabilitySchedule(availability, seed=2).intervals(5000.0)
    assert one == again
    assert one != other
    assert len(one) > 10


def test_on_off_does_not_depend_on_the_order_of_questions():
    availability = Availability("on-off", mean_on_s=5.0, mean_off_s=5.0)
    far_first = AvailabilitySchedule(availability, seed=3)
    step_by_step = AvailabilitySchedule(availability, seed=3)
    assert far_first.online(10_000.0) in (True, False)
    for t in range(0, 10_000, 7):
        step_by_step.online(float(t))
    assert far_first.intervals(10_000.0) == step_by_step.intervals(10_000.0)


def test_on_off_long_run_fraction_matches_the_means():
    mean_on, mean_off, horizon = 30.0, 10.0, 1_000_000.0
    schedule = AvailabilitySchedule(Availability("on-off", mean_on_s=mean_on, mean_off_s=mean_off), seed=7)
    online_time = sum(end - start for start, end in schedule.intervals(horizon))
    assert online_time / horizon == pytest.approx(mean_on / (mean_on + mean_off), abs=0.02)


def test_on_off_starts_online_and_next_change_is_a_flip():
    schedule = AvailabilitySchedule(Availability("on-off", mean_on_s=3.0, mean_off_s=2.0), seed=5)
    assert schedule.online(0.0)
    with pytest.raises(ValueError):
        schedule.online(math.inf)  # would draw for ever
    t = 0.0
    for _ in range(50):
        change = schedule.next_change(t)
        assert change is not None and change > t
        state = schedule.online(t)
        assert schedule.online(change - 1e-9) == state
        assert schedule.online(change) != state
        t = change
    for start, end in schedule.intervals(t):
        assert schedule.online(start) and schedule.online((start + end) / 2)
        if end < t:
            assert not schedule.online(end)


def test_nothing_changes_after_the_horizon():
    schedule = AvailabilitySchedule(Availability("on-off", mean_on_s=1.0, mean_off_s=1.0), seed=0, horizon_s=50.0)
    last = max(t for t in (schedule.next_change(x / 10) for x in range(500)) if t is not None)
    assert last < 50.0
    assert schedule.next_change(last) is None
    assert schedule.online(1e9) == schedule.online(last)


def test_a_trace_is_followed_exactly(tmp_path):
    schedule = trace_schedule(tmp_path, "# online intervals\n5,10\n\n20,30  # second\n40,inf\n")
    assert not schedule.online(0.0) and not schedule.online(4.999)
    assert schedule.online(5.0) and schedule.online(9.999)
    assert not schedule.online(10.0) and not schedule.online(19.999)
    assert schedule.online(20.0) and not schedule.online(30.0)
    assert schedule.online(40.0) and schedule.online(1e12)
    assert schedule.next_change(0.0) == 5.0
    assert schedule.next_change(4.999) == 5.0
    assert schedule.next_change(5.0) == 10.0  # strictly after t
    assert schedule.next_change(10.0) == 20.0
    assert schedule.next_change(30.0) == 40.0
    assert schedule.next_change(40.0) is None
    assert schedule.intervals(35.0) == [(5.0, 10.0), (20.0, 30.0)]
    assert schedule.intervals(50.0) == [(5.0, 10.0), (20.0, 30.0), (40.0, 50.0)]


def test_a_trace_from_zero_with_touching_intervals(tmp_path):
    schedule = trace_schedule(tmp_path, "0,10\n10,20\n25,30\n")
    assert schedule.online(0.0)
    assert schedule.next_change(0.0) == 20.0  # 10 is not a change: the intervals touch
    assert schedule.intervals(100.0) == [(0.0, 20.0), (25.0, 30.0)]
    assert schedule.next_change(30.0) is None and not schedule.online(1e6)


def test_the_shipped_example_trace_is_followed():
    path = files("firmware_sim") / "profiles" / "example-trace.csv"
    intervals = read_trace(str(path))
    assert intervals
    schedule = AvailabilitySchedule(Availability("trace", trace=str(path)), seed=0)
    for start, end in intervals:
        assert schedule.online(start)
        if math.isfinite(end):
            assert schedule.online(end - 1e-6) and not schedule.online(end)
            assert schedule.next_change(start) == end
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(intervals, intervals[1:])]
    for gap_start, gap_end in gaps:
        assert not schedule.online((gap_start + gap_end) / 2)


@pytest.mark.parametrize(
    "text, line, why",
    [
        ("0,10\n5,20\n", 2, "overlap"),
        ("0,10\n# fine\n30,40\n20,25\n", 4, "sorted"),
        ("0,10\n20,15\n", 2, "before it starts"),
        ("0,10\n20,20\n", 2, "before it starts"),
        ("0,10\n20\n", 2, "start_s,end_s"),
        ("0,ten\n", 1, "start_s,end_s"),
        ("-5,10\n", 1, "non-negative"),
    ],
)
def test_a_bad_trace_names_its_line(tmp_path, text, line, why):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"trace.csv:{line}: .*{why}"):
        read_trace(path)
    with pytest.raises(ValueError, match=f":{line}:"):
        AvailabilitySchedule(Availability("trace", trace=str(path)), seed=0)


# --- memory ----------------------------------------------------------------------------------------


def lenet_peak(batch_size: int, optimizer: str, **kwargs) -> int:
    return training_peak_bytes("lenet", 10, (1, 8, 8), batch_size, optimizer, **kwargs)


def test_peak_memory_grows_with_the_batch():
    peaks = [lenet_peak(batch, "sgd") for batch in (1, 32, 64)]
    assert peaks[0] < peaks[1] < peaks[2]
    # linear: every sample adds the same bytes (32 samples from 32 to 64, 31 from 1 to 32)
    assert (peaks[2] - peaks[1]) * 31 == (peaks[1] - peaks[0]) * 32


def test_adamw_adds_two_float32_moments_per_parameter():
    from models.zoo import build_model

    parameters = sum(p.numel() for p in build_model("lenet", 10, (1, 8, 8)).parameters())
    assert lenet_peak(32, "adamw") - lenet_peak(32, "sgd") == 2 * 4 * parameters
    assert lenet_peak(32, "adamw", num_parameters=1000) - lenet_peak(32, "sgd", num_parameters=1000) == 8000


def test_peak_memory_refuses_unknown_optimizers_and_empty_batches():
    with pytest.raises(ValueError, match="rmsprop"):
        lenet_peak(32, "rmsprop")
    with pytest.raises(ValueError):
        lenet_peak(0, "sgd")


def test_check_memory_fails_like_an_out_of_memory():
    peak = lenet_peak(32, "adamw")
    check_memory(profile_with(ram_bytes=peak), peak)
    small = profile_with(name="tiny", ram_bytes=peak - 1)
    with pytest.raises(DeviceOutOfMemory) as caught:
        check_memory(small, peak)
    assert isinstance(caught.value, MemoryError)
    assert f"{peak:,}" in str(caught.value) and f"{peak - 1:,}" in str(caught.value)
    assert (caught.value.needed, caught.value.available) == (peak, peak - 1)


def test_resnet18_does_not_fit_a_pi_zero_but_fits_a_jetson_orin():
    peak = training_peak_bytes("resnet18_cifar", 10, (3, 32, 32), 32, "adamw")
    with pytest.raises(DeviceOutOfMemory):
        check_memory(load_profile("raspberry-pi-zero-2w"), peak)
    check_memory(load_profile("jetson-orin-nano"), peak)
