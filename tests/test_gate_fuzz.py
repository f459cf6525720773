"""Property-based fuzzing of every decoder a device's bytes reach on the coordinator, and of the codec devices use.

What a hostile device can send, generated: random bytes, random msgpack values, field-level mutations (a field
removed, retyped or given a random value; an extra field) and byte-level mutations (flips, truncations,
insertions) of a valid message of every kind, and hostile attachments (damaged generator records, a JSON header
nested past the recursion limit). The properties: `wire.decode` returns a message that fits its schema or raises
`WireError`; the coordinator's gate (`Inbox.accept`) never raises and never meets an exception it has no reason
for ("unexpected" stays 0); `decode_record` raises only `GeneratorFormatError`; every rule the coordinator ships
(each registered strategy, found by the registry: a rule added later is fuzzed without being named here) refuses
hostile attachments only with `RefusedUpdate`, and aggregates the updates it took into finite models; a secure
aggregation session, on either side, meets mutated messages with `SecAggError` alone.

The suite runs a bounded, derandomized number of examples per property (EDGEFIL_FUZZ_EXAMPLES, default 150);
`scripts/fuzz-gate N` runs N random examples per property (the longer run).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_frames import pack, unpack

from coordinator.inbox import UNEXPECTED, Inbox
from coordinator.secagg import Advertised, SecureAggregationSettings, SecureMessage, SecureRound
from coordinator.strategies import ClientUpdate, RefusedUpdate, make_strategy, strategy_names
from coordinator.strategies.base import STRATEGIES, settled
from edge_client.secagg import SecureRoundSettings, SecureUpload
from edgefil import topics, wire
from edgefil.secagg import SecAggError
from models.feature_stats import STATISTICS
from models.generator_record import (
    GeneratorFormatError,
    GeneratorRecord,
    RecordLayout,
    attachment_name,
    decode_record,
    encode_record,
)
from models.generators import auxiliary_size, default_spec, exported_layouts, sampler_size

FLEET = "fuzz"
MANIFEST = "m" * 64
N_PARAMS = 300  # above MIN_CHUNK_BYTES / 4, so an update can travel in several chunks
DEVICE_KINDS = topics.DEVICE_SENDS  # what a device may publish: every kind, secure aggregation's included
FUZZ = settings(
    max_examples=int(os.environ.get("EDGEFIL_FUZZ_EXAMPLES", "150")),
    derandomize="EDGEFIL_FUZZ_EXAMPLES" not in os.environ,  # the suite is reproducible; the long run explores
    deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# Every shipped rule aggregating what it took, case by case: 60 cases a rule in the suite (eight rules; 150 took
# 50 s of its 15 minutes), the long run's count where EDGEFIL_FUZZ_EXAMPLES sets it.
RULE_FUZZ = settings(FUZZ, max_examples=int(os.environ.get("EDGEFIL_FUZZ_EXAMPLES", "60")))

leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=24) | st.binary(max_size=64))
msgpack_values = st.recursive(
    leaves, lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children,
                                                                               max_size=6),
    max_leaves=24)
json_values = st.recursive(  # what a hostile JSON header can hold
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=24),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=24)


def generator_attachment(label: int = 3) -> bytes:
    spec = default_spec("vae", (1, 8, 8))
    rng = np.random.default_rng(0)
    return encode_record(GeneratorRecord(
        label=label, spec=spec.to_dict(), precision="float16",
        sampler=rng.standard_normal(sampler_size(spec)).astype(np.float32),
        auxiliary=rng.standard_normal(auxiliary_size(spec)).astype(np.float32), trained_samples=10, steps=5))


def valid_payloads() -> dict[str, list[bytes]]:
    """A valid payload of every kind (blob kinds: every chunk), as devices and the coordinator write them."""
    weights = wire.weights_bytes(np.linspace(-1, 1, N_PARAMS, dtype=np.float32))
    data, layout = wire.pack_attachments(weights, {"generator/3": generator_attachment()})
    chunk_fields: dict[str, Any] = dict(chunk_bytes=wire.MIN_CHUNK_BYTES)
    return {
        "register": [wire.encode("register", device="dev-0", profile="pi4", backend="portable", manifest=MANIFEST,
                                 software="0.1", instance="0123456789abcdef")],
        "status": [wire.encode("status", device="dev-0", state="idle", round=3, instance="0123456789abcdef"),
                   wire.encode("status", device="dev-0", state="error", round=3, error="ValueError: bad data"),
                   wire.encode("status", device="dev-0", state="no-data", round=3, instance="0123456789abcdef"),
                   wire.encode("status", device="dev-0", state="no-data", round=3, instance="0123456789abcdef",
                               task=2),
                   wire.encode("status", device="dev-0", state="spent", round=3, instance="0123456789abcdef",
                               error="local DP: another round would take epsilon to 9.1 at delta 1e-05")],
        "request": [wire.encode("request", device="dev-0", round=3, names=["generator/1", "generator/2"])],
        "update": wire.encode_blob("update", data, device="dev-0", round=3, task=0, model=MANIFEST, num_samples=40,
                                   metrics={"loss": 0.5}, label_counts=[4] * 10,
                                   trained_counts=[[0, c, 2] for c in range(10)], attachments=layout,
                                   **chunk_fields).chunks,
        "round": [wire.encode("round", round=3, task=0, model=MANIFEST, version=2, deadline_s=30.0,
                              config={"epochs": 1}, payload="p" * 64)],
        "weights": wire.encode_blob("weights", weights, round=3, version=2, task=1, **chunk_fields).chunks,
        "payload": wire.encode_blob("payload", *wire.pack_attachments(b"", {"generator/3": b"x" * 10})[:1],
                                    round=3, attachments=[["generator/3", 10]]).chunks,
        "answer": wire.encode_blob("answer", b"", round=3, attachments=[]).chunks,
        "notice": [wire.encode("notice", reason="duplicate-device", detail="two processes",
                               instances=["0123456789abcdef", "fedcba9876543210"])],
        # secure aggregation's (edgefil/secagg.py): a session's messages each way
        "keys": [wire.encode("keys", device="dev-0", round=3, session="s1", task=0, model=MANIFEST,
                             cipher_key=bytes(range(32)), mask_key=bytes(32), commitment=b"c" * 32,
                             metrics={"loss": 0.5})],
        "shares": [wire.encode("shares", device="dev-0", round=3, session="s1", shares={"dev-1": b"s" * 170})],
        "masked": wire.encode_blob("masked", np.arange(N_PARAMS + 1, dtype="<u4").data.cast("B"), device="dev-0",
                                   round=3, session="s1", **chunk_fields).chunks,
        "reveal": [wire.encode("reveal", device="dev-0", round=3, session="s1", masks={"dev-1": b"m" * 66},
                               keys={})],
        "neighbours": [wire.encode("neighbours", round=3, session="s1", count=2, threshold=2, index=1,
                                   neighbours={"dev-1": [2, bytes(32), bytes(32)]})],
        "relayed": [wire.encode("relayed", round=3, session="s1", shares={"dev-1": b"s" * 170})],
        "unmask": [wire.encode("unmask", round=3, session="s1", survivors=["dev-1"], dropped=[])],
    }


VALID = valid_payloads()
KINDS = sorted(VALID)


def decode_or_refuse(payload: bytes) -> dict | None:
    """wire.decode's contract: a message whose fields fit its kind's schema, or WireError."""
    try:
        message = wire.decode(payload)
    except wire.WireError as err:
        assert err.reason
        return None
    kind = message["kind"]
    for name, expected in wire.SCHEMAS[kind].items():
        assert isinstance(message[name], expected) and not isinstance(message[name], bool), (kind, name)
    return message


class Gate:
    """A coordinator's gate as the server builds it, fed on every device topic."""

    def __init__(self) -> None:
        self.inbox = Inbox(FLEET, {"dev-0", "dev-1"}, manifest=MANIFEST, num_parameters=N_PARAMS)

    def feed(self, payload: bytes, kinds: tuple[str, ...] = DEVICE_KINDS) -> None:
        """On every kind's topic; as a retained message too when its length is odd (a deterministic half)."""
        retained = len(payload) % 2 == 1
        for kind in kinds:
            before, rate = sum(self.inbox.rejections.values()), self.inbox.rejections["rate"]
            topic = topics.from_device(FLEET, "dev-0", kind)
            event = self.inbox.accept(topic, payload, retained)
            counted = sum(self.inbox.rejections.values()) - before
            assert counted in (0, 1) and (event is None or counted == 0)
            if retained and counted:  # a refused retained message is deleted from the broker (not a rate refusal)
                rated = self.inbox.rejections["rate"] > rate
                assert self.inbox.to_clear == ([] if rated else [topic]), (self.inbox.to_clear, rated)
            self.inbox.to_clear.clear()
        assert self.inbox.rejections[UNEXPECTED] == 0, "the gate met an exception it has no reason for"


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_are_refused_with_a_reason(payload):
    decode_or_refuse(payload)
    Gate().feed(payload)


@FUZZ
@given(msgpack_values, st.sampled_from([None, *KINDS]), st.booleans())
def test_random_msgpack_is_refused_with_a_reason(value, kind, versioned):
    if isinstance(value, dict) and kind is not None:  # reach past the first checks: a kind and the version
        value = {**value, "kind": kind, **({"v": wire.SCHEMA_VERSION} if versioned else {})}
    payload = msgpack.packb(value, use_bin_type=True)
    decode_or_refuse(payload)
    Gate().feed(payload)


def mutate_fields(message: dict, data: st.DataObject) -> None:
    """One to three of a message's fields deleted or given any msgpack value, or a field added."""
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from([*message, "extra"]))
        if data.draw(st.booleans()) and field in message:
            del message[field]
        else:
            message[field] = data.draw(msgpack_values)


@FUZZ
@given(st.sampled_from(KINDS), st.data())
def test_field_mutations_of_valid_messages_are_refused_or_fit_the_schema(kind, data):
    chunks = [unpack(c) for c in VALID[kind]]
    target = data.draw(st.integers(0, len(chunks) - 1))
    message = chunks[target]
    mutate_fields(message, data)
    payloads = [pack(c) for c in chunks]
    for payload in payloads:
        decode_or_refuse(payload)
    gate = Gate()
    for payload in payloads:  # the whole blob, so a mutated chunk meets reassembly and the attachment checks
        gate.feed(payload, (kind,) if kind in DEVICE_KINDS else DEVICE_KINDS)


@FUZZ
@given(st.sampled_from(KINDS), st.data())
def test_byte_mutations_of_valid_messages_are_refused_or_fit_the_schema(kind, data):
    payloads = list(VALID[kind])
    target = data.draw(st.integers(0, len(payloads) - 1))
    raw = bytearray(payloads[target])
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if action == "flip" and raw:
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set" and raw:
            raw[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[at:]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    payloads[target] = bytes(raw)
    decode_or_refuse(payloads[target])
    gate = Gate()
    for payload in payloads:
        gate.feed(payload, (kind,) if kind in DEVICE_KINDS else DEVICE_KINDS)


def record_with_header(header: bytes) -> bytes:
    """A generator record whose JSON header is `header` (padded), lengths and checksum made consistent."""
    header += b" " * (-len(header) % 4)
    fixed = struct.pack("<4sIqqqqqI", b"EFGN", 1, 3, 10, 5, 1, -1, len(header))
    body = fixed + header + np.zeros(1, dtype="<f4").tobytes()
    return body + struct.pack("<I", zlib.crc32(body))


HOSTILE_HEADERS = [
    b"[" * 100_000 + b"]" * 100_000,  # past the recursion limit of json.loads
    json.dumps({"precision": "float32", "spec": {"kind": [[[]]], "input_shape": "x"}}).encode(),
    json.dumps({"precision": ["float32"], "spec": []}).encode(),
    b"\xff\xfe not utf-8",
]


@pytest.mark.parametrize("header", HOSTILE_HEADERS, ids=["deep", "bad-spec", "bad-types", "not-utf8"])
def test_hostile_generator_headers_are_format_errors(header):
    with pytest.raises(GeneratorFormatError):
        decode_record(record_with_header(header))


@FUZZ
@given(st.data())
def test_damaged_generator_records_are_format_errors(data):
    raw = bytearray(generator_attachment())
    if data.draw(st.booleans()):
        header = json.dumps(data.draw(json_values | st.fixed_dictionaries(
            {"precision": st.sampled_from(["float32", "int8"]) | json_values, "spec": json_values}))).encode()
        raw = bytearray(record_with_header(header))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    try:
        decode_record(bytes(raw))
    except GeneratorFormatError:
        pass


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from models.export import export_registered

    return export_registered("lenet", 10, tmp_path_factory.mktemp("lenet"), backends=("torch",))


# Every rule the coordinator ships (a strategy a test file defines is not one of them).
SHIPPED = [n for n in strategy_names() if STRATEGIES.get(n).__module__.startswith("coordinator.strategies.")]


def layout_record(layout: RecordLayout, label: int, scale: float, auxiliary: bool, rng: np.random.Generator,
                  precision: str = "float32") -> bytes:
    """A well-formed record of an exported layout, its values at `scale` (1e30: samples that overflow)."""
    limit = 6e4 if precision == "float16" else np.inf  # what float16 can hold
    values = lambda n: np.clip(rng.standard_normal(n) * scale, -limit, limit).astype(np.float32)  # noqa: E731
    return encode_record(GeneratorRecord(
        label=label, spec=layout.spec, precision=precision, sampler=values(layout.sampler_size),
        auxiliary=values(layout.auxiliary_size) if auxiliary else None, trained_samples=10, steps=5))


@st.composite
def hostile_attachment(draw: st.DrawFn) -> tuple[str, bytes]:
    """A name and bytes a hostile device attaches: random, a method's names with random bytes, well-formed records
    of the fleet's own layouts with any values, of specs it does not use, or with their bytes damaged."""
    label = draw(st.integers(0, 12))
    name = draw(st.text(max_size=20) | st.sampled_from([attachment_name(label), "generator/٣", "generator/03", STATISTICS]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layouts = exported_layouts((1, 8, 8))
    kind = draw(st.sampled_from(["bytes", "record", "foreign", "damaged"]))
    if kind == "bytes":
        return name, draw(st.binary(max_size=256))
    layout = draw(st.sampled_from(layouts))
    if kind == "foreign":
        spec = {**layout.spec, draw(st.sampled_from(sorted(layout.spec))): draw(json_values)}
        layout = RecordLayout(spec, draw(st.sampled_from([1, 10, layout.sampler_size])), layout.auxiliary_size)
    data = layout_record(layout, label, draw(st.sampled_from([0.0, 0.1, 1e4, 1e30])), draw(st.booleans()), rng,
                         draw(st.sampled_from(["float32", "float16", "int8"])) if kind == "record" else "float32")
    if kind == "damaged":
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
        data = bytes(raw)
    return name, data


@pytest.mark.parametrize("rule", SHIPPED)
@RULE_FUZZ
@given(data=st.data())
def test_every_rule_refuses_hostile_attachments_with_a_reason_and_aggregates_what_it_took(rule, manifest, data):
    """A rule's `inspect` refuses only with `RefusedUpdate`, and its `aggregate` of the updates it took neither
    raises nor gives a model that is not finite: the coordinator contains both anyway (coordinator/containment.py),
    but a refusal names its reason, and a failed round loses the round."""
    strategy = make_strategy(rule, device="cpu", manifest=manifest)
    size = manifest.num_parameters
    taken = []
    for k in range(data.draw(st.integers(1, 4))):
        attachments = dict(data.draw(st.lists(hostile_attachment(), max_size=3)))
        counts = data.draw(st.lists(st.integers(0, 50), max_size=12))
        weights = np.random.default_rng(k).standard_normal(size).astype(np.float32) * np.float32(0.1)
        update = ClientUpdate(f"dev-{k}", weights, data.draw(st.integers(0, 100)), label_counts=counts,
                              attachments=attachments)
        try:
            strategy.inspect(update)
        except RefusedUpdate as err:
            assert err.reason
            continue
        taken.append(update)
    if not taken:
        return
    result = settled(strategy.aggregate(torch.zeros(size), taken))
    assert bool(torch.isfinite(result.global_weights).all())
    assert all(bool(torch.isfinite(w).all()) for w in result.personalized.values())


def test_an_exception_the_gate_has_no_reason_for_is_counted_not_raised(monkeypatch):
    gate = Gate()

    def broken(payload: bytes, max_bytes: int = 0) -> dict:
        raise KeyError("a gap in the checks")

    monkeypatch.setattr(wire, "decode", broken)
    assert gate.inbox.accept(topics.from_device(FLEET, "dev-0", "status"), VALID["status"][0]) is None
    assert gate.inbox.rejections[UNEXPECTED] == 1


def test_a_valid_blob_passes_the_gate():
    """The fuzzed inputs start from messages the gate takes (else the mutations would prove nothing)."""
    inbox = Gate().inbox
    events = [inbox.accept(topics.from_device(FLEET, "dev-0", "update"), c) for c in VALID["update"]]
    assert len(VALID["update"]) > 1 and events[-1] is not None and events[-1].attachments.keys() == {"generator/3"}
    for kind in ("register", "status", "request", "keys", "shares", "reveal"):
        assert inbox.accept(topics.from_device(FLEET, "dev-0", kind), VALID[kind][0]) is not None, kind
    masked = [inbox.accept(topics.from_device(FLEET, "dev-0", "masked"), c) for c in VALID["masked"]]
    assert len(VALID["masked"]) > 1 and masked[-1] is not None and len(masked[-1].words) == N_PARAMS + 1
    assert not inbox.rejections
    for kind in ("round", "weights", "payload", "answer", "neighbours", "relayed", "unmask"):
        assert all(decode_or_refuse(c) is not None for c in VALID[kind]), kind


SESSION_STAGES = ("neighbours", "shares", "relayed", "unmask", "reveal")


@FUZZ
@given(st.sampled_from(SESSION_STAGES), st.data())
def test_a_secure_session_meets_mutated_messages_with_a_reason_only(stage, data):
    """Secure aggregation's session (coordinator/secagg.py, edge_client/secagg.py) among four devices, with one
    message of dev-0's at `stage` (one it receives or one it sends) field-mutated after the codec took it: the
    device's part and the coordinator's session raise nothing but SecAggError, and a sum they still give is finite.
    (A message of another session or round never reaches either: the device's loop and `SecureRound.take` pass it
    over; a device field unlike its topic is the gate's `impersonation`.)"""
    rng = np.random.default_rng(0)
    settings_ = SecureAggregationSettings(mode="secagg+", clip_range=1.0, max_weight=100.0)
    secure = SecureRound(settings_, 3, "s1", 11)
    uploads = {f"dev-{i}": SecureUpload(f"dev-{i}", 3, SecureRoundSettings("s1", 1.0, 100.0),
                                        rng.normal(0, 0.05, 10), 20, 0, MANIFEST, {}) for i in range(4)}
    for device, upload in uploads.items():
        m = wire.decode(upload.advertisement)
        secure.advertise(Advertised(device, 3, 0, MANIFEST, "s1", m["cipher_key"], m["mask_key"], m["commitment"], {}))

    def hostile(payload: bytes, at: str) -> wire.Message | None:
        """The message as decoded, dev-0's at `stage` mutated (None: the codec refuses what it became)."""
        message = wire.decode(payload)
        if at != stage:
            return message
        mutated = unpack(payload)
        for _ in range(data.draw(st.integers(1, 2))):
            field = data.draw(st.sampled_from(sorted(set(mutated) - {"v", "kind", "session", "round", "device"})))
            mutated[field] = data.draw(msgpack_values)
        return decode_or_refuse(pack(mutated))

    try:
        sent = secure.begin_sharing(np.random.default_rng(1))
        for device, payload in sent.items():
            received = hostile(payload, "neighbours" if device == "dev-0" else "")
            if received is not None:
                reply = hostile(uploads[device].on_neighbours(received), "shares" if device == "dev-0" else "")
                if reply is not None:
                    secure.take(SecureMessage(device, "shares", 3, "s1", reply))
        for device, payload in secure.begin_masking().items():
            received = hostile(payload, "relayed" if device == "dev-0" else "")
            if received is not None:
                blob = uploads[device].on_relayed(received)
                words = np.frombuffer(b"".join(bytes(f.data) for f in blob.frames), dtype="<u4")
                secure.take(SecureMessage(device, "masked", 3, "s1", {}, words))
        for device, payload in secure.begin_unmasking().items():
            received = hostile(payload, "unmask" if device == "dev-0" else "")
            if received is not None:
                reply = hostile(uploads[device].on_unmask(received), "reveal" if device == "dev-0" else "")
                if reply is not None:
                    secure.take(SecureMessage(device, "reveal", 3, "s1", reply))
        summed = secure.result()
    except SecAggError:
        return
    assert np.isfinite(summed.mean_change).all() and np.isfinite(summed.samples)


def site_sides():
    """The coordinator's side of a site `a` of dev-0 and dev-1, closing round 3 with the aggregator `i1` up, and
    that site's valid messages by topic kind: its state, a word on an update, and its share (one chunk)."""
    from coordinator.aggregation import RoundAggregate
    from coordinator.containment import ContainedStrategy
    from coordinator.guard_settings import OFF, GuardSettings
    from coordinator.round_share import Heard, SharePlan
    from coordinator.sites import Sites, heard_message, partial_blob
    from edgefil.link import BrokerSettings, Link

    plan = SharePlan(FLEET, frozenset({"dev-0", "dev-1"}), MANIFEST, N_PARAMS, "fedavg")
    sites = Sites(Link(BrokerSettings(), "fuzz"), plan, {"a": plan.roster}, 1.0, lambda _: None)
    sites.take(topics.site(FLEET, "a", "state"), wire.encode("site-state", site="a", instance="i1", state="up"))
    sites._closing = 3  # (as `close` sets it; nothing is published to a link that never connected)
    counters: Any = __import__("collections").Counter()
    aggregate = RoundAggregate(ContainedStrategy(make_strategy("fedavg", device="cpu"), counters),
                               GuardSettings(**OFF), np.zeros(N_PARAMS, np.float32), counters, 1 << 30)
    aggregate.add(ClientUpdate("dev-0", np.ones(N_PARAMS, np.float32), 3, {"loss": 0.5}))
    update = Inbox(FLEET, {"dev-0"}, MANIFEST, N_PARAMS).accept(
        topics.from_device(FLEET, "dev-0", "update"), VALID["update"][0])
    valid = {"state": [wire.encode("site-state", site="a", instance="i1", state="up")],
             "heard": [heard_message("a", "i1", Heard("a", "dev-0", 3, None, update))],
             "partial": partial_blob("a", "i1", 3, aggregate.partial()).chunks}
    return sites, valid


@FUZZ
@given(st.sampled_from(["state", "heard", "partial"]), st.booleans(), st.data())
def test_a_sites_mutated_messages_are_refused_with_a_reason_only(kind, inner, data):
    """What a site sends the coordinator (coordinator/sites.py), its fields mutated, or the fields of the share's
    own map inside its blob: `Sites.take` counts and logs what it cannot use and raises nothing."""
    sites, valid = site_sides()
    message = unpack(valid[kind][0])
    if inner and kind == "partial":  # the share's map inside the blob: the sums' spec, the used records, the counts
        attachments = dict(wire.Blob("x", memoryview(bytes(message["data"])), message).split(0)[1])
        about = msgpack.unpackb(bytes(attachments["partial"]), raw=False)
        for _ in range(data.draw(st.integers(1, 3))):
            about[data.draw(st.sampled_from([*about, "extra"]))] = data.draw(msgpack_values)
        attachments = {name: bytes(value) for name, value in attachments.items()}
        attachments["partial"] = msgpack.packb(about, use_bin_type=True)
        blob, layout = wire.pack_attachments(b"", attachments)
        payload = wire.encode_blob("site-partial", blob, site="a", instance="i1", round=3,
                                   attachments=layout).chunks[0]
    else:
        mutate_fields(message, data)
        payload = pack(message)
    sites.take(topics.site(FLEET, "a", kind), payload)
