"""Broadcast payloads: what a method sends once to every device (GLFC's best old model), not once per device.

A strategy returns named payloads for the whole fleet in `AggregateResult.broadcast`. The coordinator keeps the
latest as one blob whose id is its content (`wire.blob_id`, with the names in its header): it is published once on
the fleet-wide topic when it changes, and every round message names it (`broadcast`). A device keeps the blobs it
holds by id and waits only for one it does not hold, so a payload that changes once per task is downloaded once per
task. This object remembers which process of each device (its registration's instance) the current blob reached:
a device that was offline when it was published, joined later, or restarted (a new instance, its memory empty) is
sent it on its own topic with its next round message. Sending the same named payloads again changes nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from edgefil import wire

MAX_BROADCAST_BYTES = 64 << 20  # what a device assembles at most (edge_client.device.MAX_PAYLOAD_BYTES)


class Broadcast:
    """The fleet's current broadcast blob and the device processes it reached."""

    def __init__(self) -> None:
        self.payloads: dict[str, bytes] = {}
        self._encoded: wire.EncodedBlob | None = None
        self._reached: dict[str, str] = {}  # device -> the instance the current blob reached

    @property
    def id(self) -> str | None:
        """The current blob's id (None before a method broadcast anything)."""
        return None if self._encoded is None else self._encoded.id

    @property
    def frames(self) -> list[wire.Frame]:
        """The current blob's chunk messages, to publish."""
        return [] if self._encoded is None else self._encoded.frames

    def replace(self, payloads: Mapping[str, bytes], round_: int) -> bool:
        """Make `payloads` the fleet's broadcast; True when it changed (publish it to every device). ValueError for
        what a device could not take: names that are not strings, values that are not bytes, a blob over the limit."""
        if not payloads or dict(payloads) == self.payloads:
            return False
        if not all(isinstance(k, str) and isinstance(v, (bytes, bytearray)) for k, v in payloads.items()):
            raise ValueError("broadcast payloads must be named byte strings")
        data, layout = wire.pack_attachments(b"", payloads)
        if len(data) > MAX_BROADCAST_BYTES:
            raise ValueError(f"a broadcast of {len(data)} bytes is over the {MAX_BROADCAST_BYTES} a device takes")
        self.payloads = {k: bytes(v) for k, v in payloads.items()}
        self._encoded = wire.encode_blob("broadcast", data, round=round_, attachments=layout)
        self._reached = {}
        return True

    def reached(self, devices: Iterable[tuple[str, str]]) -> None:
        """The current blob was sent to these (device, instance) pairs."""
        self._reached.update(devices)

    def needs(self, device: str, instance: str) -> bool:
        """Whether this device process still lacks the current blob."""
        return self._encoded is not None and self._reached.get(device) != instance
