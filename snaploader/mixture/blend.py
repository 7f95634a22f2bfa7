"""The mixture's randomness, pure and counter-based: which source the g-th draw of the
stream takes (a uniform number from the seed and g alone, against the weights in force),
and the order of each pass over a source (a seeded permutation of its items computed
item by item, in O(1) memory whatever the source's size). Nothing here keeps state:
where the stream stands is the sampler's (``mixture/mixture.py``'s ``MixtureSampler``), so any position is
reached again from a few counters.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Final

_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
_BLEND_TAG: Final = 0x4D49585455524531  # keeps the blend's draws apart from the passes'
_PASS_TAG: Final = 0x5041535345533031
_ROUNDS: Final = 4


def splitmix(x: int) -> int:
    """SplitMix64's finaliser: a 64-bit value mixed into another, a bijection."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def name_key(name: str) -> int:
    """A source name as 64 bits, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def uniform(seed: int, draw: int) -> float:
    """The blend's uniform number in [0, 1) for the stream's draw number ``draw``."""
    return (splitmix(splitmix(seed ^ _BLEND_TAG) ^ draw) >> 11) * 2.0**-53


def choose(names: Sequence[str], weights: Mapping[str, float], u: float) -> str:
    """The source that ``u`` picks under ``weights`` (names in a fixed order, so that
    the pick does not depend on the order a dict was written in)."""
    total = math.fsum(weights[name] for name in names)
    edge = 0.0
    last = names[0]
    for name in names:
        w = weights[name]
        if w <= 0:
            continue
        edge += w / total
        last = name
        if u < edge:
            return name
    return last  # u within rounding of 1: the last source with weight


def pass_key(seed: int, name: str, pass_: int) -> int:
    """The key of the permutation of pass ``pass_`` over source ``name``."""
    return splitmix(splitmix(seed ^ _PASS_TAG) ^ splitmix(name_key(name) ^ splitmix(pass_)))


def permuted(position: int, length: int, key: int) -> int:
    """The item at ``position`` of the permutation of ``range(length)`` that ``key``
    names: a Feistel network over the smallest even-bit domain holding ``length``,
    walked until it lands inside (a bijection of the domain, so of the range too)."""
    half = max(1, ((length - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for round_ in range(_ROUNDS):
            left, right = right, left ^ (splitmix(key ^ (round_ << 56) ^ right) & mask)
        x = (left << half) | right
        if x < length:
            return x
