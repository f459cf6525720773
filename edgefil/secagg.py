"""Secure aggregation's arithmetic, the part a device and the coordinator share (SecAgg+: Bell, Bonawitz, Gascon,
Lepoint and Raykova 2020, after Bonawitz et al. 2017; Flower's SecAgg+ follows the same paper).

A device's contribution is quantised into integers mod 2^32 (`Quantiser`), then hidden under masks that cancel in
the sum: one pairwise mask per neighbour, +PRG(s_ij) on one side and -PRG(s_ij) on the other, s_ij agreed by X25519
(`agree`), and a self mask PRG(b_i). Each device splits b_i and its masking key into Shamir shares (`split`), one per
neighbour, sealed for that neighbour alone (`seal`), so that when a device drops out after the masks were agreed the
others can give the coordinator what it needs to cancel its pairwise masks (its key), and for every device that
stayed, what it needs to take off its self mask (b_i), never both for one device.

Choices, each the paper's or a standard one where it is silent:
- Masks are ChaCha20 keystreams (`mask`): a cryptographic PRG, fast without AES instructions (a Raspberry Pi 4's
  cores have none), from `cryptography`, which ships wheels for aarch64 and x86_64 and the device install carries.
- Keys are fresh per session (one attempt of one round): a key revealed for a device that dropped masks nothing
  later. Shared secrets go through HKDF-SHA256, with the session and the pair in its info.
- Shamir's field is GF(2^521 - 1), a Mersenne prime above every 32-byte secret: one share per secret.
- Shares travel sealed with ChaCha20-Poly1305 under a key agreed from a second X25519 pair, with the session, the
  sender and the receiver as associated data: the coordinator, which relays them, reads none, and cannot pass one
  off as another's.
- A device commits to b_i (its SHA-256) when it advertises its keys, and a reconstructed masking key must match the
  public key its device advertised: a device that sends a wrong share makes the round fail, not its sum wrong.
"""
from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PRIME = 2**521 - 1  # Shamir's field
SHARE_BYTES = 66  # a field element, big-endian
SECRET_BYTES = 32
KEY_BYTES = 32  # an X25519 public key
WORD = np.dtype("<u4")  # the masked vector's element: arithmetic mod 2^32
MODULUS = 2**32
NONCE_BYTES = 12
SEAL, MASK = "seal", "mask"  # what an agreed secret is for (HKDF's info)


class SecAggError(ValueError):
    """A session message or secret that cannot be used; `reason` is the short tag counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# --- keys, agreement, sealing --------------------------------------------------------------------

@dataclass(frozen=True)
class KeyPair:
    private: X25519PrivateKey
    public: bytes  # raw, KEY_BYTES

    @classmethod
    def generate(cls) -> KeyPair:
        private = X25519PrivateKey.generate()
        return cls(private, public_bytes(private))

    @classmethod
    def from_private(cls, raw: bytes) -> KeyPair:
        private = X25519PrivateKey.from_private_bytes(raw)
        return cls(private, public_bytes(private))

    def private_bytes(self) -> bytes:
        return self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption())


def public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def agree(own: KeyPair, peer_public: bytes, purpose: str, session: str, a: str, b: str) -> bytes:
    """The 32-byte secret two devices share for `purpose` in `session`: X25519, then HKDF-SHA256 over the pair
    (ordered, so both sides derive the same)."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError("key", f"a public key of {len(peer_public)} bytes, not {KEY_BYTES}")
    shared = own.private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    first, second = sorted((a, b))
    info = f"edgefil secagg {purpose} {session} {first} {second}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise SecAggError("share-sealed", "a sealed share that does not open with the pair's key") from None


def commitment(secret: bytes) -> bytes:
    return hashlib.sha256(b"edgefil secagg commitment" + secret).digest()


# --- masks ----------------------------------------------------------------------------------------

def mask(seed: bytes, length: int) -> np.ndarray:
    """`length` uint32 words of ChaCha20 keystream under `seed` (a fresh key per session, so a zero nonce)."""
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * length)), dtype=WORD)


def add_mask(vector: np.ndarray, seed: bytes, sign: int) -> None:
    """vector += sign x mask(seed), mod 2^32, in place."""
    words = mask(seed, len(vector))
    if sign > 0:
        np.add(vector, words, out=vector)
    else:
        np.subtract(vector, words, out=vector)


def pairwise_sign(device: str, neighbour: str) -> int:
    """+1 towards a later id, -1 towards an earlier one: a pair's two masks cancel in the sum."""
    return 1 if device < neighbour else -1


# --- Shamir ---------------------------------------------------------------------------------------

def split(secret: bytes, points: Iterable[int], threshold: int) -> dict[int, bytes]:
    """Shares of `secret` at each of `points` (distinct, non-zero), any `threshold` of which give it back."""
    value = int.from_bytes(secret, "big")
    coefficients = [value, *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    shares = {}
    for x in points:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from `threshold` of `shares` (the first by point): Lagrange at 0."""
    if len(shares) < threshold:
        raise SecAggError("too-few-shares", f"{len(shares)} shares, {threshold} needed")
    points = sorted(shares)[:threshold]
    secret = 0
    for j in points:
        numerator, denominator = 1, 1
        for m in points:
            if m != j:
                numerator = numerator * m % PRIME
                denominator = denominator * (m - j) % PRIME
        secret = (secret + int.from_bytes(shares[j], "big") * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise SecAggError("shares-inconsistent", "the shares give no 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")


def share_value(data: object) -> bytes:
    """A share as the wire carries it, checked."""
    if not isinstance(data, bytes) or len(data) != SHARE_BYTES or int.from_bytes(data, "big") >= PRIME:
        raise SecAggError("share", "a share is not a field element")
    return data


# --- quantisation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Quantiser:
    """What a device sends, as integers whose sum over `count` devices stays below 2^32: its change to the global
    model times its weight f in [0, 1], each value clipped to [-clip_range, clip_range], then f itself, each mapped
    onto 0..levels with stochastic rounding (unbiased). levels = floor((2^32 - 1) / count): no sum of at most
    `count` contributions wraps."""

    clip_range: float
    count: int

    @property
    def levels(self) -> int:
        return (MODULUS - 1) // max(1, self.count)

    def encode(self, weighted_change: np.ndarray, weight: float, rng: np.random.Generator) -> np.ndarray:
        c, levels = self.clip_range, self.levels
        scaled = np.empty(len(weighted_change) + 1)
        np.clip(weighted_change, -c, c, out=scaled[:-1])
        scaled[:-1] += c
        scaled[:-1] *= levels / (2 * c)
        scaled[-1] = min(max(weight, 0.0), 1.0) * levels
        scaled += rng.random(len(scaled))
        return np.minimum(np.floor(scaled), levels).astype(WORD)

    def decode(self, total: np.ndarray, contributors: int) -> tuple[np.ndarray, float]:
        """The summed weighted change and the summed weight of `contributors` encoded vectors."""
        c, levels = self.clip_range, self.levels
        change = total[:-1].astype(np.float64) * (2 * c / levels) - contributors * c
        return change, float(total[-1]) / levels

    def in_range(self, change: np.ndarray, weight: float, contributors: int) -> bool:
        """Whether a decoded sum is one that `contributors` honest encodings can give (a device that sends
        anything else shows here, in the sum, though not whose it was). The modulus leaves room outside that range
        only for the devices that dropped: with every device of the session in the sum, any vector decodes within
        it, and a lying device can move each value of the sum anywhere inside +-contributors x clip_range."""
        slack = contributors * 2 * self.clip_range / self.levels  # the rounding's
        bound = contributors * self.clip_range + slack
        return math.isfinite(weight) and -slack <= weight <= contributors + slack and bool(
            np.abs(change).max(initial=0.0) <= bound)
