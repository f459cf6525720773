"""One secure aggregation session in one process, its devices and coordinator speaking through the wire codec: the
driver tests/test_secagg.py and the emulated aarch64 device's test share (numpy and edgefil only, which the device
install carries)."""
from __future__ import annotations

import numpy as np

from coordinator.secagg import Advertised, SecureAggregationSettings, SecureMessage, SecureRound
from edge_client.secagg import SecureRoundSettings, SecureUpload
from edgefil import wire

SESSION = "s1"
SETTINGS = SecureAggregationSettings(mode="secagg+", clip_range=1.0, max_weight=100.0)


def devices_of(n: int, length: int, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, int]]:
    """Each device's change (float64) and its sample count."""
    return {f"dev-{i}": (rng.normal(0, 0.05, length), int(rng.integers(5, 60))) for i in range(n)}


STAGES = ("keys", "shares", "masked")  # what a device has sent last when it drops: its keys, its shares, its vector


def run_session(devices: dict[str, tuple[np.ndarray, int]], drop: dict[str, str] | None = None,
                lies: dict[str, str] | None = None, weighted: bool = True
                ) -> tuple[SecureRound, dict[str, SecureUpload], list[bytes]]:
    """One session through the codec; `drop`: the stage (of STAGES) after which a device says nothing more; `lies`:
    what a device does wrong ("sealed": the shares it seals for its first four neighbours are random bytes;
    "sealed-all": for all of them; "revealed": the shares it reveals are off by one; "masked": its masked vector is
    shifted by 2^31); `weighted`: the rule weighs by samples. Returns
    the round, the devices' sessions and the masked vectors as the coordinator received them."""
    drop, lies = drop or {}, lies or {}
    length = len(next(iter(devices.values()))[0]) + 1
    secure = SecureRound(SETTINGS, 1, SESSION, length, weighted)
    settings = SecureRoundSettings(SESSION, SETTINGS.clip_range, SETTINGS.max_weight, weighted)
    uploads = {d: SecureUpload(d, 1, settings, change, n, 0, "model", {"loss": 0.5})
               for d, (change, n) in devices.items()}
    for device, upload in uploads.items():
        m = wire.decode(upload.advertisement)
        secure.advertise(Advertised(m["device"], m["round"], m["task"], m["model"], m["session"], m["cipher_key"],
                                    m["mask_key"], m["commitment"], m["metrics"]))
    masked: list[bytes] = []

    def masked_vector(upload: SecureUpload, message: wire.Message) -> SecureMessage:
        reassembler, whole = wire.Reassembler(1 << 30), None
        for chunk in upload.on_relayed(message).chunks:
            whole = reassembler.add(upload.device, wire.decode(chunk)) or whole
        assert whole is not None
        words = whole.words(length) + np.uint32(2**31 if lies.get(upload.device) == "masked" else 0)
        masked.append(words.tobytes())
        return SecureMessage(upload.device, "masked", 1, SESSION, whole.header, words)

    def reveal(upload: SecureUpload, message: wire.Message) -> SecureMessage:
        reply = wire.decode(upload.on_unmask(message))
        if lies.get(upload.device) == "revealed":
            reply["masks"] = {k: (int.from_bytes(v, "big") + 1).to_bytes(66, "big") for k, v in reply["masks"].items()}
        return SecureMessage(upload.device, "reveal", 1, SESSION, reply)

    def shares(upload: SecureUpload, message: wire.Message) -> SecureMessage:
        reply = wire.decode(upload.on_neighbours(message))
        lie = lies.get(upload.device, "")
        if lie.startswith("sealed"):
            spoilt = sorted(reply["shares"])[: None if lie == "sealed-all" else 4]
            reply["shares"] = {k: bytes(rng.integers(0, 256, len(v), dtype=np.uint8)) if k in spoilt else v
                               for k, v in reply["shares"].items()}
        return SecureMessage(upload.device, "shares", 1, SESSION, reply)

    rng = np.random.default_rng(2)

    for done, begin, answer in ((0, lambda: secure.begin_sharing(np.random.default_rng(1)), shares),
                                (1, secure.begin_masking, masked_vector), (2, secure.begin_unmasking, reveal)):
        for device, payload in begin().items():
            if drop.get(device) not in STAGES[:done + 1]:  # it has not dropped yet
                secure.take(answer(uploads[device], wire.decode(payload)))
    return secure, uploads, masked


def expected_mean(devices: dict[str, tuple[np.ndarray, int]], survivors: set[str]) -> np.ndarray:
    weights = {d: devices[d][1] / SETTINGS.max_weight for d in survivors}
    return sum(weights[d] * devices[d][0] for d in survivors) / sum(weights.values())


