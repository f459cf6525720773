"""What the devices of one process share of the global models: one read-only array per model, and the check of
the message that brought it, made once.

A fleet worker hosts hundreds or thousands of devices, and every one of them receives every global model, over
its own connection, at about the same time. Their links hand them one payload object for the same bytes
(`edgefil.link.SharedPayloads`), and `shared_model` gives them one array for the same blob id. Between the two,
each device decoded that payload, checked its chunk's CRC32C, hashed the blob with BLAKE3 and summed the weights to
prove them finite: the same work on the same object, once a device. A model of one chunk (below
`wire.CHUNK_BYTES`, as most are) that one device of the process has verified is known by that object
(`verified_model`), so another device handed the very object takes the blob id and fields the first one checked,
and the array: 0.7 us a device where the decode and the checks took 68.6 us for a LeNet's 124 KB (zlib's CRC-32
key included, which `SharedPayloads` no longer takes), a fifth of a CPU-second a round at 3000 devices (1914 of
which only receive the model; docs/results.md, "A device's round without what it repeats"). The devices of a
process share its memory and trust each other's checks; a payload that is another object, or a model of several
chunks, is decoded and checked by each device as ever.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

_shared_models: weakref.WeakValueDictionary[str, np.ndarray] = weakref.WeakValueDictionary()
# id of a payload object -> (a weak reference to it, the blob id it carries, the blob's fields): only while it lives
_by_payload: dict[int, tuple[weakref.ref[Any], str, dict[str, Any]]] = {}
# Re-entrant: `remember_verified`'s weak reference calls back into it when its payload goes, and that may happen
# in a thread that holds it already: a finalizer runs wherever the last reference goes, which the cyclic collector
# can make any allocation, and a free-threaded build any point at which the thread frees what another let go of.
# A plain lock there hung a fleet worker's network thread, and with it every device of the worker (workers on
# CPython 3.13's free-threaded build: docs/results.md, "Fleet workers on a free-threaded CPython").
_lock = threading.RLock()


def shared_model(blob_id: str, weights: np.ndarray) -> np.ndarray:
    """One read-only array per global model in a process. The devices a fleet worker hosts all receive the same
    broadcast weights and kept up to KEPT_MODELS of them each: a thousand devices held a thousand copies. The id is
    the blob's BLAKE3, checked by the reassembler, so one id is one content. Held weakly: an array goes when no
    device keeps it."""
    with _lock:
        kept = _shared_models.get(blob_id)
        if kept is None:
            weights.flags.writeable = False
            kept = _shared_models[blob_id] = weights
        return kept


def remember_verified(payload: object, blob_id: str, header: dict[str, Any]) -> None:
    """`payload`, the whole message of a one-chunk global model, was decoded and its blob verified: `blob_id`, with
    the blob's fields `header`. Forgotten when the payload goes; a payload that cannot be referenced weakly (bytes)
    is not remembered."""
    key = id(payload)

    def forget(reference: weakref.ref[Any]) -> None:
        with _lock:
            if _by_payload.get(key, (None,))[0] is reference:
                del _by_payload[key]

    try:
        reference = weakref.ref(payload, forget)
    except TypeError:
        return
    with _lock:
        _by_payload[key] = (reference, blob_id, header)


def verified_model(payload: object) -> tuple[str, dict[str, Any], np.ndarray] | None:
    """The blob id, fields and shared array of the global model that this very payload object carries, where a
    device of the process verified it (`remember_verified`) and the array is still held; else None (decode it)."""
    with _lock:
        entry = _by_payload.get(id(payload))
        if entry is None or entry[0]() is not payload:
            return None
        weights = _shared_models.get(entry[1])
    return None if weights is None else (entry[1], entry[2], weights)
