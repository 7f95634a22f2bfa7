"""Per-sample seeds (``DataLoader(seed_per_sample=True)``): before a sample is read, the
three global RNGs and every captured generator object are set to states derived from
(the epoch's sample seed, the sample's key) alone, so what a sample draws does not depend
on which worker reads it, in which batch, next to which others, or after a respawn.

The epoch's sample seed is :func:`epoch_seed` of (the run's root, the epoch); a
key is a map-style sample's dataset index, a batch's index for the draws ``collate_fn``
makes, or (logical worker, item position) for an iterable's items (``Domain``).

NOTE [ per-sample root ]
The root is the base seed of the loader's first epoch, carried to every later epoch
and through checkpoints (``sample_root``), not each epoch's own base seed: persistent
workers draw a base seed once (as torch's do) and a fresh iterator every epoch, so
only the first is common to both; with it, a sample's draws are a function of (the
generator's state at the first epoch, the epoch, the key) whatever persistent_workers
and num_workers. A checkpoint written before the root was recorded holds none: its
epoch's base seed is taken as the root, which is the seed that epoch drew with.

NOTE [ cheap per-sample states ]
Seeding is what costs: ``random.seed(int)`` runs init_by_array (10-40 µs on the 2-core
machine), ``torch.manual_seed`` seeds every device (1.2 ms), and the C seeders of NumPy's
legacy generator and torch's CPU generator keep only 32 bits of the seed, so among a
million samples about a hundred pairs would share a stream. A Mersenne Twister state is
624 words and a position; any words but all zeros make a valid state, and position 624
makes the next draw twist all of them first, as after seeding. So the words are made
for a whole batch of keys at once, by SplitMix64 (a start per key from two rounds of its
mixer over (seed, domain, key), then its stream from there) in a few vectorized NumPy
passes, and each sample's are written raw before it is read (``_rng/raw.py``; torch's
through a template state and one ``set_state``). The words must be unrelated from one
key to the next: the twist is linear over GF(2), so states differing by a pattern
linear in the key (a base state XOR a few words) would give first draws that agree in
most words. Measured by ``python -m stress.seed_per_sample_cost``.
"""

from __future__ import annotations

import enum
import hashlib
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

from .kinds import _PCG, _PHILOX, _SFC
from .objects import ObjectRngs
from .raw import _MT_WORDS, _TORCH_PACKED, _TORCH_WORDS_AT, _TORCH_WORDS_END, _numpy_rng, _python_rng

_MASK64: Final = (1 << 64) - 1
_EPOCH = struct.Struct("<qq")  # base seed, epoch
_POSITION: Final = struct.pack("<i", _MT_WORDS)  # "twist before the next draw"
_HALF: Final = _MT_WORDS // 2  # 64-bit words holding a Mersenne Twister's 624 32-bit ones
# SplitMix64's constants (Steele, Lea, Flood 2014): the step and the two multipliers.
_GAMMA: Final = np.uint64(0x9E3779B97F4A7C15)
_M1: Final = np.uint64(0xBF58476D1CE4E5B9)
_M2: Final = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_PYTHON, _NUMPY, _TORCH = slice(0, _HALF), slice(_HALF, 2 * _HALF), slice(2 * _HALF, 3 * _HALF)
_GLOBAL_WORDS: Final = 3 * _HALF


class Domain(enum.IntEnum):
    """What a key names; each draws from its own part of the seed space."""

    SAMPLE = 0  # a map-style dataset index
    BATCH = 1  # a map-style batch's index in the epoch (collate_fn's draws)
    ITEM = 2  # an iterable's item: its position in its logical worker's epoch


def epoch_seed(base_seed: int, epoch: int) -> int:
    """The 64-bit seed every sample of an epoch derives its states from."""
    digest = hashlib.blake2b(_EPOCH.pack(base_seed, epoch), digest_size=8, person=b"snaploader-epoch").digest()
    return int.from_bytes(digest, "little")


def index_key(index: Any) -> int:
    """A dataset index as a 64-bit key: ints (NumPy's too) as they are; any other index
    (a str, a tuple) by a hash of its ``repr``, which must then not vary between runs."""
    try:
        return operator.index(index) & _MASK64
    except TypeError:
        digest = hashlib.blake2b(repr(index).encode("utf-8", "backslashreplace"), digest_size=8).digest()
        return int.from_bytes(digest, "little")


def _keys(indices: Sequence[Any]) -> np.ndarray:
    try:
        return np.asarray(indices, dtype=np.int64).astype(np.uint64)
    except (TypeError, ValueError, OverflowError):
        return np.array([index_key(index) for index in indices], dtype=np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, in place."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


class _TorchTemplate:
    """A torch CPU generator state as a freshly seeded one has it (position: twist next,
    no cached normal), whose 624 words are replaced in place before each ``set_state``."""

    def __init__(self) -> None:
        self.state = torch.Generator().manual_seed(1).get_state().numpy().copy()
        self.tensor = torch.from_numpy(self.state)  # shares the memory
        # torch keeps each 32-bit word in a 64-bit slot, the high half zero
        self.words = self.state[_TORCH_WORDS_AT:_TORCH_WORDS_END].view("<u4")[0::2]
        self.seed = self.state[:8].view("<u8")

    def put(self, generator: torch.Generator, words: np.ndarray) -> None:
        """``words``: 312 64-bit words, taken as 624 32-bit ones."""
        self.words[:] = words.view("<u4")
        self.seed[0] = words[0] >> np.uint64(1)  # what torch.initial_seed() reports
        generator.set_state(self.tensor)


def _object_writer(code: int, access: Any, template: _TorchTemplate | None) -> tuple[int, Callable[[np.ndarray], None]]:
    """(64-bit words it takes, a function writing a state made of them) for a generator
    object of kind ``code`` (``_rng/kinds.py``)."""
    if code in (1, 2):  # random.Random, RandomState
        return _HALF, lambda words: access.write_words(words.data.cast("B"))
    if code == 3:  # MT19937 bit generator: position and words, no gaussian
        return _HALF, lambda words: access.write(_POSITION + words.tobytes())
    if code == 8:
        generator = access.generator
        if template is None:
            return 1, lambda words: generator.manual_seed(int(words[0]))
        return _HALF, lambda words: template.put(generator, words)
    if code in (4, 5):  # PCG64, PCG64DXSM: state, odd increment
        return 4, lambda words: access.write(_PCG.pack(*(int(x) for x in words[:2]), int(words[2]) | 1, int(words[3]), 0, 0))
    if code == 6:  # SFC64: three words and its counter
        return 3, lambda words: access.write(_SFC.pack(*(int(x) for x in words), 1, 0, 0))
    if code == 7:  # Philox: a key, the counter from 0, an empty buffer
        return 2, lambda words: access.write(_PHILOX.pack(0, 0, 0, 0, *(int(x) for x in words), 0, 0, 0, 0, 4, 0, 0))
    raise ValueError(f"no per-sample state for generator kind {code}")


class SampleSeeder:
    """Sets one worker's generators to a key's states (see the module docstring):
    :meth:`states` makes them for a batch of keys, :meth:`put` writes one key's."""

    def __init__(self, objects: ObjectRngs) -> None:
        self.template = _TorchTemplate() if _TORCH_PACKED else None
        self.writers = [_object_writer(code, access, self.template) for code, access in zip(objects.codes, objects.access)]
        self.width = _GLOBAL_WORDS + sum(count for count, _ in self.writers)
        self.steps = np.arange(1, self.width + 1, dtype=np.uint64) * _GAMMA

    def states(self, seed: int, domain: Domain, keys: Sequence[Any], stream: int = 0) -> np.ndarray:
        """One row of words per key. ``stream`` tells apart keys of one domain that
        would collide (an iterable's logical workers)."""
        tag = np.uint64((int(domain) + 1) * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7 & _MASK64)
        starts = _mix(_mix(_keys(keys) + tag) ^ np.uint64(seed & _MASK64))
        return _mix(starts[:, None] + self.steps[None, :])

    def put(self, row: np.ndarray) -> None:
        """Set the global generators and the captured objects to ``row``'s states."""
        _python_rng.write_words(row[_PYTHON].data.cast("B"))
        _numpy_rng.write_words(row[_NUMPY].data.cast("B"))
        if self.template is not None:
            self.template.put(torch.default_generator, row[_TORCH])
        else:
            torch.default_generator.manual_seed(int(row[_TORCH][0]))
        at = _GLOBAL_WORDS
        for count, write in self.writers:
            write(row[at : at + count])
            at += count
