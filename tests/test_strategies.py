"""Aggregation rules: FedAvg and FedProx against float64 numpy references, input checks, zero-copy inputs."""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from coordinator.compute import as_tensor, resolve_device
from coordinator.strategies import ClientUpdate, RoundContext, make_strategy, makes_inputs, strategy_names
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedprox import FedProx

SIZE = 1000
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def read_only(array: np.ndarray) -> np.ndarray:
    """The array as the network delivers it: np.frombuffer over bytes, hence read-only."""
    return np.frombuffer(array.astype("<f4").tobytes(), dtype="<f4")


def make_updates(rng: np.random.Generator, count: int, samples: list[int] | None = None) -> list[ClientUpdate]:
    samples = samples if samples is not None else rng.integers(1, 500, count).tolist()
    return [ClientUpdate(f"dev-{k}", read_only(rng.standard_normal(SIZE)), n) for k, n in enumerate(samples)]


def global_weights(device: torch.device = CPU) -> torch.Tensor:
    return torch.zeros(SIZE, dtype=torch.float32, device=device)


def stacked(updates: list[ClientUpdate]) -> np.ndarray:
    return np.stack([u.weights.astype(np.float64) for u in updates])


def assert_close(actual: torch.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype == torch.float32 and actual.shape == (SIZE,)
    # float32 accumulation: error relative to the magnitude of the summed terms, not of the (possibly ~0) result
    np.testing.assert_allclose(actual.cpu().numpy(), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


def test_weighted_fedavg_is_the_sample_weighted_mean():
    rng = np.random.default_rng(0)
    updates = make_updates(rng, 7)
    n = np.array([u.num_samples for u in updates], dtype=np.float64)
    result = FedAvg(device="cpu").aggregate(global_weights(), updates)
    assert_close(result.global_weights, (n[:, None] * stacked(updates)).sum(0) / n.sum())
    assert result.personalized == {}


def test_unweighted_fedavg_is_the_plain_mean():
    rng = np.random.default_rng(1)
    updates = make_updates(rng, 5)
    result = FedAvg(weighted=False, device="cpu").aggregate(global_weights(), updates)
    assert_close(result.global_weights, stacked(updates).mean(0))


def test_one_update_gives_its_weights_back():
    update = make_updates(np.random.default_rng(2), 1)[0]
    for weighted in (True, False):
        result = FedAvg(weighted=weighted, device="cpu").aggregate(global_weights(), [update])
        np.testing.assert_array_equal(result.global_weights.numpy(), update.weights)


def test_weighted_fedavg_without_samples_falls_back_to_the_plain_mean():
    updates = make_updates(np.random.default_rng(3), 4, samples=[0, 0, 0, 0])
    result = FedAvg(weighted=True, device="cpu").aggregate(global_weights(), updates)
    assert_close(result.global_weights, stacked(updates).mean(0))


def test_devices_with_zero_samples_get_no_weight():
    updates = make_updates(np.random.default_rng(4), 3, samples=[0, 10, 30])
    result = FedAvg(device="cpu").aggregate(global_weights(), updates)
    assert_close(result.global_weights, (10 * stacked(updates)[1] + 30 * stacked(updates)[2]) / 40)


def test_fedprox_sends_mu_and_aggregates_as_fedavg():
    updates = make_updates(np.random.default_rng(5), 6)
    prox = FedProx(mu=0.3, device="cpu")
    assert prox.configure(RoundContext(round=2), devices=["a", "b"]) == {"a": {"mu": 0.3}, "b": {"mu": 0.3}}
    assert FedAvg(device="cpu").configure(RoundContext(round=2), devices=["a", "b"]) == {"a": {}, "b": {}}
    for weighted in (True, False):
        expected = FedAvg(weighted=weighted, device="cpu").aggregate(global_weights(), updates).global_weights
        actual = FedProx(mu=0.3, weighted=weighted, device="cpu").aggregate(global_weights(), updates).global_weights
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("mu", [-0.1, float("nan"), float("inf")])
def test_fedprox_refuses_a_bad_mu(mu):
    with pytest.raises(ValueError, match="mu"):
        FedProx(mu=mu, device="cpu")


def test_bad_rounds_are_refused():
    rng = np.random.default_rng(6)
    strategy = FedAvg(device="cpu")
    good = make_updates(rng, 2)
    with pytest.raises(ValueError, match="no updates"):
        strategy.aggregate(global_weights(), [])
    short = ClientUpdate("short", read_only(rng.standard_normal(SIZE - 1)), 5)
    with pytest.raises(ValueError, match="short"):
        strategy.aggregate(global_weights(), [*good, short])
    wrong_dtype = ClientUpdate("f64", rng.standard_normal(SIZE), 5)
    with pytest.raises(ValueError, match="f64"):
        strategy.aggregate(global_weights(), [*good, wrong_dtype])
    strided = ClientUpdate("strided", read_only(rng.standard_normal(2 * SIZE))[::2], 5)
    with pytest.raises(ValueError, match="strided"):
        strategy.aggregate(global_weights(), [*good, strided])
    with pytest.raises(ValueError, match="num_samples"):
        strategy.aggregate(global_weights(), [*good, ClientUpdate("neg", good[0].weights, -1)])
    with pytest.raises(ValueError, match="more than one"):
        strategy.aggregate(global_weights(), [good[0], ClientUpdate(good[0].device, good[1].weights, 3)])
    with pytest.raises(ValueError, match="global weights"):
        strategy.aggregate(global_weights().double(), good)


def test_read_only_inputs_are_read_in_place_and_left_untouched():
    updates = make_updates(np.random.default_rng(7), 4)
    before = [u.weights.copy() for u in updates]
    assert not any(u.weights.flags.writeable for u in updates)
    for u in updates:
        assert as_tensor(u.weights, CPU).data_ptr() == u.weights.__array_interface__["data"][0]
    FedAvg(device="cpu").aggregate(global_weights(), updates)
    for u, b in zip(updates, before):
        np.testing.assert_array_equal(u.weights, b)


def test_read_only_inputs_raise_no_warning():
    # torch warns once per process, so a fresh interpreter is the only place where the check is not vacuous
    code = ("import numpy as np, torch; from coordinator.strategies import ClientUpdate; from coordinator.strategies.fedavg import FedAvg; "
            "w = np.frombuffer(bytes(80), dtype='<f4'); "
            "FedAvg(device='cpu').aggregate(torch.zeros(10), [ClientUpdate('a', w[:10], 1), ClientUpdate('b', w[10:], 2)])")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_read_only_inputs_are_wrapped_without_dlpack(monkeypatch):
    """numpy < 2.1 cannot export read-only arrays over DLPack; as_tensor then wraps them with torch.from_numpy."""

    def no_read_only_export(array, **kwargs):
        raise BufferError("Cannot export readonly array since signalling readonly is unsupported by DLPack.")

    monkeypatch.setattr(torch, "from_dlpack", no_read_only_export)
    weights = read_only(np.arange(SIZE, dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = as_tensor(weights, CPU)
    assert tensor.data_ptr() == weights.__array_interface__["data"][0]
    np.testing.assert_array_equal(tensor.numpy(), weights)


def test_as_tensor_refuses_what_is_not_a_flat_float32_buffer():
    with pytest.raises(ValueError):
        as_tensor(np.zeros((2, 3), dtype=np.float32), CPU)
    with pytest.raises(ValueError):
        as_tensor(np.zeros(3, dtype=">f4"), CPU)
    with pytest.raises(ValueError):
        as_tensor(np.zeros(6, dtype=np.float32)[::-2], CPU)


def test_make_strategy():
    assert set(strategy_names()) >= {"fedavg", "fedprox", "pfedgrp", "median", "trimmed-mean",
                                     "centered-clip"}  # and plugins
    prox = make_strategy("fedprox", device="cpu", mu=0.5, weighted=False)
    assert isinstance(prox, FedProx) and prox.mu == 0.5 and not prox.weighted and prox.device == CPU
    assert isinstance(make_strategy("fedavg", device="cpu"), FedAvg)
    with pytest.raises(ValueError, match="unknown strategy .scaffold.; choose one of centered-clip, fedavg, fedprox"):
        make_strategy("scaffold")
    with pytest.raises(ValueError, match="manifest"):
        make_strategy("pfedgrp", device="cpu")


def test_a_rule_that_makes_inputs_says_so_and_takes_their_range():
    """`Strategy.makes_inputs` is the contract the coordinator reads to give a rule the data's range: every rule
    that takes `input_range` declares it, and none declares it without taking one."""
    import inspect

    from coordinator.strategies.base import STRATEGIES

    for name in strategy_names():
        takes = "input_range" in inspect.signature(STRATEGIES.get(name)).parameters
        assert makes_inputs(name) == takes, name
    assert makes_inputs("glfc") and makes_inputs("sdd") and not makes_inputs("fedavg")


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            resolve_device("cuda")
        with pytest.raises(RuntimeError, match="CUDA"):
            FedAvg(device="cuda")


@needs_cuda
def test_cuda_matches_cpu():
    updates = make_updates(np.random.default_rng(8), 9)
    for weighted in (True, False):
        on_cpu = FedAvg(weighted=weighted, device="cpu").aggregate(global_weights(), updates).global_weights
        on_gpu = FedAvg(weighted=weighted, device="cuda").aggregate(global_weights(torch.device("cuda")), updates)
        assert on_gpu.global_weights.device.type == "cuda"
        torch.testing.assert_close(on_gpu.global_weights.cpu(), on_cpu, rtol=1e-6, atol=1e-6)
