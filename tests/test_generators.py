"""Class generators: architectures, the ONNX sampler, the record format, the bank, and both training backends."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from edge_client.generators import bank as bank_module
from edge_client.generators.bank import BankFullError, GeneratorBank
from edge_client.generators.choice import make_generator_trainer
from edge_client.generators.sampler import OnnxSampler
from firmware_sim.datasets import load_digits_dataset
from models.generator_record import (
    PRECISIONS,
    GeneratorFormatError,
    GeneratorRecord,
    decode_record,
    encode_record,
    encoded_size,
    quantize,
)
from models.generators import (
    GENERATOR_KINDS,
    GeneratorSpec,
    auxiliary_size,
    build_auxiliary,
    build_sampler,
    default_spec,
    flatten_module,
    load_module,
    sampler_size,
)
from models.manifest import ManifestError

SHAPES = [(1, 8, 8), (1, 40), (1, 28, 28), (3, 32, 32)]


@pytest.fixture(scope="module")
def generator_artifacts(tmp_path_factory):
    """Export (once per module) and return the artifact folder of default_spec(kind, shape)."""
    from models.generator_export import export_generator_artifacts

    cache = {}

    def get(kind: str, shape: tuple[int, ...]):
        if (kind, shape) not in cache:
            out = tmp_path_factory.mktemp(f"generator-{kind}")
            cache[kind, shape] = export_generator_artifacts(default_spec(kind, shape), out)
        return cache[kind, shape]

    return get


@pytest.fixture(scope="module")
def digit_three() -> np.ndarray:
    data = load_digits_dataset()
    return data.x_train[data.y_train == 3]


def _random_weights(spec: GeneratorSpec, seed: int) -> tuple[torch.nn.Module, np.ndarray]:
    """A sampler with random weights and non-trivial BatchNorm statistics, in eval mode, and its flat buffer."""
    sampler = build_sampler(spec, seed)
    with torch.no_grad():
        for name, buffer in sampler.named_buffers():
            if name.endswith(("running_mean", "running_var")):
                buffer.uniform_(0.5, 1.5)
    return sampler.eval(), flatten_module(sampler)


def _record(spec: GeneratorSpec, label: int = 3, seed: int = 0, precision: str = "float32",
            auxiliary: bool = True) -> GeneratorRecord:
    rng = np.random.default_rng(seed)
    return GeneratorRecord(
        label=label, spec=spec.to_dict(), precision=precision,
        sampler=rng.standard_normal(sampler_size(spec)).astype(np.float32),
        auxiliary=rng.standard_normal(auxiliary_size(spec)).astype(np.float32) if auxiliary else None,
        trained_samples=137, steps=200,
    )


# ---------------------------------------------------------------- architectures


@pytest.mark.parametrize("shape", [(8, 5), (8, 3, 4)])
def test_sub_pixel_shuffle_doubles_each_spatial_size_moving_every_value_once(shape):
    """The conv VAE's upsampling: (N, C * 2^d, *S) -> (N, C, *2S), a permutation of the values in which output
    position (2i + a, 2j + b) of channel c takes input channel c * 2^d + (a, b)'s group, position (i, j)."""
    from models.generators import _SubPixel

    x = torch.arange(2 * np.prod(shape), dtype=torch.float32).reshape(2, *shape)
    y = _SubPixel()(x)
    up = 2 ** (len(shape) - 1)
    assert y.shape == (2, shape[0] // up, *(2 * d for d in shape[1:]))
    assert torch.equal(y.flatten().sort().values, x.flatten())
    if len(shape) == 2:
        assert torch.equal(y[:, :, 1::2], x[:, 1::2])
    else:
        assert torch.equal(y[:, :, 1::2, 0::2], x[:, 2::4])  # a = 1, b = 0: group 2 of each output channel


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", GENERATOR_KINDS)
def test_every_kind_builds_for_every_shape(kind, shape):
    spec = default_spec(kind, shape)
    sampler, auxiliary = build_sampler(spec, 0).eval(), build_auxiliary(spec, 1)
    with torch.no_grad():
        x = sampler(torch.randn(3, spec.latent_dim))
        out = auxiliary(x)
    assert x.shape == (3, *shape)
    if kind == "wgan-gp":
        assert out.shape == (3,)
    else:
        assert [t.shape for t in out] == [(3, spec.latent_dim)] * 2
    flat = flatten_module(sampler)
    assert flat.dtype == np.float32 and flat.shape == (sampler_size(spec),)
    assert len(flatten_module(auxiliary)) == auxiliary_size(spec)
    if len(shape) == 3:  # images lie in [0, 1]
        assert 0 <= float(x.min()) and float(x.max()) <= 1
    copy = build_sampler(spec, 7).eval()
    load_module(copy, flat)
    assert torch.equal(copy(torch.ones(2, spec.latent_dim)), sampler(torch.ones(2, spec.latent_dim)))


def test_the_specs_28x28_wgan_gp_sizes():
    spec = GeneratorSpec("wgan-gp", (1, 28, 28), latent_dim=32, width=32)
    assert sum(p.numel() for p in build_sampler(spec).parameters()) == 136_993
    assert sum(p.numel() for p in build_auxiliary(spec).parameters()) == 36_513
    assert sampler_size(spec) == 136_993 + 2 * (64 + 32)  # + BatchNorm running means and variances


def test_seeded_builds_are_reproducible_and_leave_the_global_rng_alone():
    spec = default_spec("vae", (1, 40))
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a = flatten_module(build_sampler(spec, seed=4))
    assert torch.equal(torch.rand(1), expected)
    assert np.array_equal(a, flatten_module(build_sampler(spec, seed=4)))


def test_spec_dict_round_trip_and_validation():
    spec = default_spec("wgan-gp", (1, 8, 8))
    data = json.loads(json.dumps(spec.to_dict()))
    assert GeneratorSpec.from_dict(data) == spec
    with pytest.raises(ValueError, match="unknown generator kind"):
        GeneratorSpec.from_dict({**data, "kind": "ddpm"})
    with pytest.raises(ValueError):
        GeneratorSpec.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="divisible by 4"):
        GeneratorSpec("wgan-gp", (1, 30), 16, 32)
    with pytest.raises(ValueError):
        GeneratorSpec("vae", (1, 8, 8), 0, 32)
    assert GeneratorSpec("vae", (1, 30), 8, 16).input_shape == (1, 30)  # the VAE takes any shape


def test_load_module_refuses_bad_buffers():
    spec = default_spec("vae", (1, 8, 8))
    sampler = build_sampler(spec, 0)
    flat = flatten_module(sampler)
    for bad in (flat[:-1], flat.astype(np.float64), np.where(np.arange(len(flat)) == 5, np.nan, flat)
                .astype(np.float32)):
        with pytest.raises(ValueError):
            load_module(sampler, bad)
    assert np.array_equal(flatten_module(sampler), flat)


# ---------------------------------------------------------------- the ONNX sampler


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 40)])
@pytest.mark.parametrize("kind", GENERATOR_KINDS)
def test_onnx_sampler_equals_torch_sampler(generator_artifacts, kind, shape):
    sampler = OnnxSampler(generator_artifacts(kind, shape))
    spec = GeneratorSpec.from_dict(sampler.info.spec)
    assert sampler.info.sampler_size == sampler_size(spec)
    z = np.random.default_rng(0).standard_normal((5, spec.latent_dim)).astype(np.float32)
    for seed in (1, 2):  # one file serves any weights of the spec
        module, flat = _random_weights(spec, seed)
        expected = module(torch.from_numpy(z)).detach().numpy()
        np.testing.assert_allclose(sampler.run(z, flat), expected, rtol=1e-5, atol=1e-5)


def test_sampler_draws_from_the_rng_and_refuses_other_specs(generator_artifacts):
    sampler = OnnxSampler(generator_artifacts("vae", (1, 8, 8)))
    spec = GeneratorSpec.from_dict(sampler.info.spec)
    record = _record(spec)
    a = sampler.sample(record, 4, np.random.default_rng(5))
    assert a.shape == (4, 1, 8, 8) and a.dtype == np.float32
    assert np.array_equal(a, sampler.sample(record, 4, np.random.default_rng(5)))
    assert sampler.sample(record, 0, np.random.default_rng(5)).shape == (0, 1, 8, 8)
    with pytest.raises(ValueError, match="spec"):
        sampler.sample(_record(default_spec("vae", (1, 40))), 2, np.random.default_rng(0))
    with pytest.raises(ValueError):
        sampler.sample(replace(record, sampler=record.sampler[:-1]), 2, np.random.default_rng(0))


def test_tampered_artifacts_are_refused(generator_artifacts, tmp_path):
    source = generator_artifacts("wgan-gp", (1, 40))
    for name in os.listdir(source):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    data = bytearray((tmp_path / "sampler.onnx").read_bytes())
    data[-5] ^= 1
    (tmp_path / "sampler.onnx").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256"):
        OnnxSampler(tmp_path)


def test_export_is_deterministic(generator_artifacts, tmp_path):
    from models.generator_export import export_generator_artifacts

    first = generator_artifacts("vae", (1, 40))
    second = export_generator_artifacts(default_spec("vae", (1, 40)), tmp_path)
    assert sorted(os.listdir(first)) == sorted(os.listdir(second))
    for name in os.listdir(first):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


# ---------------------------------------------------------------- the record format


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("auxiliary", [True, False])
def test_record_round_trip(precision, auxiliary):
    spec = default_spec("wgan-gp", (1, 8, 8))
    record = _record(spec, auxiliary=auxiliary)
    record = replace(record, sampler=record.sampler * np.float32(3))  # values beyond one int8 step everywhere
    data = encode_record(replace(record, precision=precision))
    assert len(data) % 4 == 0
    assert len(data) == encoded_size(spec.to_dict(), precision, len(record.sampler),
                                     len(record.auxiliary) if auxiliary else None)
    back = decode_record(data)
    assert (back.label, back.spec, back.precision, back.trained_samples, back.steps) == \
           (3, spec.to_dict(), precision, 137, 200)
    assert (back.auxiliary is None) == (not auxiliary)
    for original, decoded in [(record.sampler, back.sampler)] + ([(record.auxiliary, back.auxiliary)]
                                                                  if auxiliary else []):
        assert decoded.dtype == np.float32 and decoded.shape == original.shape
        error = np.abs(decoded - original)
        if precision == "float32":
            assert np.array_equal(decoded, original)
        elif precision == "float16":
            assert (error <= np.abs(original) * 2.0**-11 + 2.0**-24).all()
        else:  # int8: half a step of the block's scale
            pad = -len(original) % 1024
            block_max = np.repeat(np.abs(np.pad(original, (0, pad))).reshape(-1, 1024).max(axis=1), 1024)
            assert (error <= block_max[: len(original)] / 254 * (1 + 1e-5)).all()
    stored = quantize(record, precision)  # what a device keeps equals what it gets back
    assert np.array_equal(stored.sampler, back.sampler)
    again = quantize(stored, precision)
    assert np.array_equal(again.sampler, stored.sampler) and encode_record(again) == encode_record(stored)


def test_record_refuses_values_it_cannot_store():
    record = _record(default_spec("vae", (1, 8, 8)), auxiliary=False)
    with pytest.raises(ValueError):
        encode_record(replace(record, sampler=np.full_like(record.sampler, np.inf)))
    with pytest.raises(ValueError):
        encode_record(replace(record, sampler=np.full_like(record.sampler, 1e6), precision="float16"))
    with pytest.raises(ValueError):
        encode_record(replace(record, precision="bfloat16"))


def _resealed(data: bytearray) -> bytes:
    """Bytes with a fresh checksum: damage the CRC alone would not catch."""
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return bytes(data)


def test_corrupt_records_are_refused():
    good = encode_record(_record(default_spec("vae", (1, 8, 8))))
    bad = [good[:-4], good[:20], good + b"\0\0\0\0", b"", bytes(len(good))]
    for position in (0, 5, 9, 60, len(good) // 2, len(good) - 1):
        flipped = bytearray(good)
        flipped[position] ^= 0x10
        bad.append(bytes(flipped))
    wrong_version = bytearray(good)
    wrong_version[4] = 2
    bad.append(_resealed(wrong_version))
    longer = bytearray(good)
    longer[32] += 1  # declared sampler length one more than the payload holds
    bad.append(_resealed(longer))
    nan = bytearray(good)
    nan[-8:-4] = struct.pack("<f", np.nan)
    bad.append(_resealed(nan))
    for data in bad:
        with pytest.raises(GeneratorFormatError):
            decode_record(data)


# ---------------------------------------------------------------- the bank


def test_bank_put_get_delete_and_reopen(tmp_path):
    spec = default_spec("vae", (1, 8, 8))
    bank = GeneratorBank(tmp_path / "bank")
    assert bank.classes() == []
    bank.put(quantize(_record(spec, label=3), "int8"))
    bank.put(_record(spec, label=11, auxiliary=False))
    assert bank.classes() == [3, 11]
    assert np.array_equal(bank.get(3).sampler, quantize(_record(spec, label=3), "int8").sampler)
    bank.put(_record(spec, label=3, seed=9))  # replaces
    assert np.array_equal(bank.get(3).sampler, _record(spec, label=3, seed=9).sampler)
    assert sorted(os.listdir(tmp_path / "bank")) == ["class-11.gen", "class-3.gen"]
    reopened = GeneratorBank(tmp_path / "bank")
    assert reopened.classes() == [3, 11] and reopened.removed_on_open == []
    reopened.delete(11)
    assert reopened.classes() == [3]
    with pytest.raises(KeyError):
        reopened.get(11)
    assert reopened.bytes_on_disk() >= (tmp_path / "bank" / "class-3.gen").stat().st_size


def test_bank_refuses_before_writing_and_never_exceeds_its_limit(tmp_path, monkeypatch):
    spec = default_spec("vae", (1, 8, 8))
    allowed = {"bytes": 10**9}
    bank = GeneratorBank(tmp_path / "bank", limit=lambda: allowed["bytes"])
    bank.put(_record(spec, label=1, auxiliary=False))
    old = (tmp_path / "bank" / "class-1.gen").read_bytes()

    peaks = []
    real_replace = os.replace

    def watched_replace(src, dst):  # the peak: the new file written, the old one not yet gone
        peaks.append(bank.bytes_on_disk())
        real_replace(src, dst)

    monkeypatch.setattr(bank_module.os, "replace", watched_replace)
    bigger = _record(spec, label=1, seed=5)
    need = bank.bytes_needed(bigger)
    allowed["bytes"] = need - 1
    with pytest.raises(BankFullError):
        bank.put(bigger)
    assert os.listdir(tmp_path / "bank") == ["class-1.gen"] and peaks == []
    assert (tmp_path / "bank" / "class-1.gen").read_bytes() == old
    allowed["bytes"] = need
    bank.put(bigger)
    assert peaks and peaks[0] <= need
    for label in range(2, 6):  # a tight limit that moves: every put either fits or is refused untouched
        allowed["bytes"] = bank.bytes_needed(_record(spec, label=label)) - (label % 2)
        before = sorted(os.listdir(tmp_path / "bank"))
        try:
            bank.put(_record(spec, label=label))
            assert peaks[-1] <= allowed["bytes"] and bank.bytes_on_disk() <= allowed["bytes"]
        except BankFullError:
            assert sorted(os.listdir(tmp_path / "bank")) == before


def test_bank_cleans_crash_leftovers_and_removes_damaged_files(tmp_path):
    spec = default_spec("vae", (1, 8, 8))
    directory = tmp_path / "bank"
    bank = GeneratorBank(directory)
    for label in (1, 2, 3):
        bank.put(_record(spec, label=label, auxiliary=False))
    (directory / "class-4.gen.tmp").write_bytes(b"half a record")  # a put killed before its rename
    damaged = bytearray((directory / "class-2.gen").read_bytes())
    damaged[100] ^= 1
    (directory / "class-2.gen").write_bytes(bytes(damaged))
    (directory / "class-3.gen").write_bytes(encode_record(_record(spec, label=7, auxiliary=False)))  # misfiled
    reopened = GeneratorBank(directory)
    assert reopened.classes() == [1] and reopened.removed_on_open == [2, 3]
    assert os.listdir(directory) == ["class-1.gen"]
    (directory / "notes.txt").write_text("not the bank's")
    with pytest.raises(ValueError, match="not the bank's"):
        GeneratorBank(directory)


SAMPLE_WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # any import of torch (or onnx) now fails
    sys.modules["onnx"] = None
    import numpy as np
    from edge_client.generators.bank import GeneratorBank
    from edge_client.generators.sampler import OnnxSampler
    from edge_client.generators.choice import make_generator_trainer
    bank, artifacts = GeneratorBank(sys.argv[1]), sys.argv[2]
    x = OnnxSampler(artifacts).sample(bank.get(3), 6, np.random.default_rng(0))
    trainer = make_generator_trainer(bank.get(3).spec, "ort", artifacts)
    sampler, encoder = trainer.train(x, bank.get(3), 3, np.random.default_rng(1))
    try:  # the guard must bite: the torch backend cannot load here
        import edge_client.generators.torch_training
        raise SystemExit("torch was importable")
    except ImportError:
        pass
    print(x.shape, x.dtype, len(sampler), len(trainer.losses))
    """
)


def test_sampling_and_ort_training_work_without_torch(generator_artifacts, tmp_path):
    artifacts = generator_artifacts("vae", (1, 8, 8))
    spec = default_spec("vae", (1, 8, 8))
    GeneratorBank(tmp_path / "bank").put(quantize(_record(spec), "float16"))
    done = subprocess.run([sys.executable, "-c", SAMPLE_WITHOUT_TORCH, str(tmp_path / "bank"), str(artifacts)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(6,", "1,", "8,", "8)", "float32", str(sampler_size(spec)), "3"]


# ---------------------------------------------------------------- training


def test_ort_vae_training_lowers_its_loss_and_loads_into_torch(generator_artifacts, digit_three):
    artifacts = generator_artifacts("vae", (1, 8, 8))
    trainer = make_generator_trainer(default_spec("vae", (1, 8, 8)), "ort", artifacts)
    sampler, encoder = trainer.train(digit_three, None, 100, np.random.default_rng(0))
    assert np.mean(trainer.losses[-10:]) < 0.5 * np.mean(trainer.losses[:10])
    assert encoder.shape == (trainer.auxiliary_size,)
    spec = GeneratorSpec.from_dict(trainer.spec)
    module = build_sampler(spec)
    load_module(module, sampler)
    z = np.random.default_rng(1).standard_normal((8, spec.latent_dim)).astype(np.float32)
    onnx_sampler = OnnxSampler(artifacts)
    np.testing.assert_allclose(onnx_sampler.run(z, sampler), module.eval()(torch.from_numpy(z)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    # a warm start continues from the stored generator: its first loss is already low
    fresh_start = trainer.losses[0]
    record = GeneratorRecord(3, trainer.spec, "float32", sampler, encoder, len(digit_three), 100)
    trainer.train(digit_three, record, 5, np.random.default_rng(2))
    assert trainer.losses[0] < 0.5 * fresh_start


@pytest.mark.parametrize("kind, shape", [("vae", (1, 8, 8)), ("conv-vae", (1, 8, 8)), ("conv-vae", (1, 40))])
def test_torch_and_ort_vae_take_the_same_steps(generator_artifacts, digit_three, one_torch_thread, kind, shape):
    """Both backends train every VAE kind (the conv VAE's sub-pixel decoder has gradient kernels on ORT 1.19,
    which a ConvTranspose has not), step for step alike."""
    x = digit_three if shape == (1, 8, 8) else np.random.default_rng(5).standard_normal((50, *shape), np.float32)
    ort = make_generator_trainer(default_spec(kind, shape), "ort", generator_artifacts(kind, shape))
    sampler, encoder = ort.train(x, None, 0, np.random.default_rng(0))  # the checkpoint's weights
    start = GeneratorRecord(3, ort.spec, "float32", sampler, encoder, 0, 0)
    torch_trainer = make_generator_trainer(ort.spec, "torch")
    a = ort.train(x, start, 5, np.random.default_rng(3))
    b = torch_trainer.train(x, start, 5, np.random.default_rng(3))
    np.testing.assert_allclose(ort.losses, torch_trainer.losses, rtol=1e-4)
    np.testing.assert_allclose(a[0], b[0], atol=1e-4)


def _mean_gap(sampler: OnnxSampler, record: GeneratorRecord, x: np.ndarray) -> float:
    samples = sampler.sample(record, 400, np.random.default_rng(7))
    return float(np.abs(samples.mean(axis=0) - x.mean(axis=0)).mean())


@pytest.fixture
def one_torch_thread():
    """Tiny models: one thread is fastest, and immune to other processes competing for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind, steps, options", [("vae", 60, {}), ("conv-vae", 60, {}),
                                                  ("wgan-gp", 60, {"lr": 5e-4, "n_critic": 3})])
def test_torch_training_moves_samples_towards_the_class(generator_artifacts, digit_three, one_torch_thread, kind,
                                                        steps, options):
    spec = default_spec(kind, (1, 8, 8))
    sampler = OnnxSampler(generator_artifacts(kind, (1, 8, 8)))
    trainer = make_generator_trainer(spec, "torch", batch_size=32, **options)
    trained, auxiliary = trainer.train(digit_three, None, steps, np.random.default_rng(0))
    fresh = flatten_module(build_sampler(spec, 0).eval())
    record = GeneratorRecord(3, spec.to_dict(), "float32", trained, auxiliary, len(digit_three), steps)
    gap = _mean_gap(sampler, record, digit_three)
    assert gap < 0.5 * _mean_gap(sampler, replace(record, sampler=fresh), digit_three)
    if kind != "wgan-gp":
        assert np.mean(trainer.losses[-10:]) < 0.5 * np.mean(trainer.losses[:10])
    # a warm start with the auxiliary model kept, and one without it (a fresh critic)
    for warm in (record, replace(record, auxiliary=None)):
        again, _ = trainer.train(digit_three, warm, 5, np.random.default_rng(1))
        assert _mean_gap(sampler, replace(record, sampler=again), digit_three) < 2 * gap + 0.02


def test_make_generator_trainer_refusals(generator_artifacts):
    with pytest.raises(ValueError, match="double backward"):
        make_generator_trainer(default_spec("wgan-gp", (1, 8, 8)), "ort", generator_artifacts("wgan-gp", (1, 8, 8)))
    with pytest.raises(ValueError, match="unknown generator backend"):
        make_generator_trainer(default_spec("vae", (1, 8, 8)), "jax")
    with pytest.raises(ValueError, match="holds artifacts"):
        make_generator_trainer(default_spec("vae", (1, 40)), "ort", generator_artifacts("vae", (1, 8, 8)))
    trainer = make_generator_trainer(default_spec("vae", (1, 8, 8)), "torch")
    with pytest.raises(ValueError):
        trainer.train(np.zeros((4, 1, 40), dtype=np.float32), None, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="spec"):
        trainer.train(np.zeros((4, 1, 8, 8), dtype=np.float32), _record(default_spec("vae", (1, 40))), 1,
                      np.random.default_rng(0))
